"""Deliberately broken engines: each mutant patches ONE engine instance through a declared seam
(kvpage.engine.hooks) or a public method — never a private name, never a branch in the hot path,
never a module-level change — to reproduce one realistic bug. The mutation check runs the suites against each and demands that every mutant is caught and
that its first divergence is attributed (kvpage.verify.diff) to the class that matches its bug.
Mutants are grouped by the class of bug they plant, one module per class."""

from kvpage.verify.mutants.base import MissingSeam, Mutant
from kvpage.verify.mutants.cache import CACHE_MUTANTS
from kvpage.verify.mutants.crashes import CRASH_MUTANTS
from kvpage.verify.mutants.generations import GENERATION_MUTANTS
from kvpage.verify.mutants.kernels import KERNEL_MUTANTS
from kvpage.verify.mutants.layer_groups import LAYER_GROUP_MUTANTS
from kvpage.verify.mutants.lora import LORA_MUTANTS
from kvpage.verify.mutants.namespaces import NAMESPACE_MUTANTS
from kvpage.verify.mutants.policy import POLICY_MUTANTS
from kvpage.verify.mutants.prompt_logprobs import PROMPT_LOGPROB_MUTANTS
from kvpage.verify.mutants.properties import PROPERTY_MUTANTS
from kvpage.verify.mutants.quantized import QUANTIZED_MUTANTS
from kvpage.verify.mutants.resources import RESOURCE_MUTANTS
from kvpage.verify.mutants.sampling import SAMPLING_MUTANTS
from kvpage.verify.mutants.speculative import SPECULATIVE_MUTANTS
from kvpage.verify.mutants.stop import STOP_MUTANTS
from kvpage.verify.mutants.structured import STRUCTURED_MUTANTS

MUTANTS: tuple[Mutant, ...] = (
    *CACHE_MUTANTS,
    *GENERATION_MUTANTS,
    *SAMPLING_MUTANTS,
    *STOP_MUTANTS,
    *RESOURCE_MUTANTS,
    *NAMESPACE_MUTANTS,
    *POLICY_MUTANTS,
    *QUANTIZED_MUTANTS,
    *PROMPT_LOGPROB_MUTANTS,
    *PROPERTY_MUTANTS,
    *LORA_MUTANTS,
    *LAYER_GROUP_MUTANTS,
    *STRUCTURED_MUTANTS,
    *SPECULATIVE_MUTANTS,
    *KERNEL_MUTANTS,
    *CRASH_MUTANTS,
)

__all__ = ["MUTANTS", "MissingSeam", "Mutant"]
