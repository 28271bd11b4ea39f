"""Typed exceptions. Library code raises these, never bare Exception/assert, for anything a user
or an operator can cause or must see."""


class KVPageError(Exception):
    """Base of every kvpage error."""


# --- loading ---------------------------------------------------------------------------------
class ModelLoadError(KVPageError):
    """A model directory or builtin name could not be turned into a model."""


class ConfigNotFound(ModelLoadError):
    """The directory has no config.json."""


class UnsupportedModel(ModelLoadError):
    """config.json names a model_type (or a RoPE scaling type) kvpage does not implement."""


class MissingWeight(ModelLoadError):
    """A tensor the model needs is not in any safetensors file."""


class WeightShapeMismatch(ModelLoadError):
    """A tensor is present but its shape differs from what the config implies."""


# --- requests --------------------------------------------------------------------------------
class InvalidRequest(KVPageError, ValueError):
    """A request (prompt or sampling parameters) is malformed; the engine keeps serving others."""


class UnknownModel(ModelLoadError, InvalidRequest):
    """The model name is neither a builtin model nor an existing directory."""


class TokenizerNotFound(ModelLoadError, InvalidRequest):
    """Text was given but the model has no tokenizer to encode it."""


class InvalidConfig(KVPageError, ValueError):
    """An engine/cache/scheduler setting is out of range or inconsistent."""


class UnsupportedQuantization(InvalidConfig):
    """Weight quantization was asked for where its kernel does not run (a dtype or a device
    torch's int8 weight-only matmul refuses). Raised at load, before anything is served."""


class SwapError(KVPageError):
    """Copying KV to or from the CPU swap space failed (or was made to fail by a test)."""


# --- cache -----------------------------------------------------------------------------------
class InvariantViolation(KVPageError):
    """A cache invariant does not hold (a block state transition the pool refuses, or a fact the
    step-end checker recomputes differently). Always a bug, never a user error."""


class OutOfBlocks(KVPageError):
    """An allocation could not be satisfied; nothing was changed."""


# --- tensor parallel -------------------------------------------------------------------------
class TensorParallelError(KVPageError):
    """Tensor parallelism cannot run this model or setting (e.g. heads that do not divide)."""


class WorkerFailure(TensorParallelError):
    """A tensor-parallel worker died or stopped answering; the group is shut down and the
    engine fails every request it held."""


class LoRAError(InvalidRequest):
    """An adapter that cannot be loaded or served: the message names the field or tensor."""
