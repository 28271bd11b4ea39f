"""Server and router mutants: realistic bugs of the stack above the engine, each planted in one
app or one router instance through a declared seam (kvpage.server.seams, `Router.tree_factory`,
`Router.holders`, `PrefixTree.touch`) or a public method — never a private name, never a
module-level change.
The gate demands the whole-stack suite catch each one with its own attribution class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpage.engine.engine import LLMEngine
from kvpage.serve_replicas.prefix_router import Router
from kvpage.serve_replicas.prefix_tree import PrefixTree
from kvpage.server.seams import SEAMS as SERVER_SEAMS
from kvpage.server.tenants import Tenants
from kvpage.server.text_stream import Detokenizer, TextStream
from kvpage.verify.mutants.base import MissingSeam, bind, replace
from kvpage.verify.stack.server_suite import StackTarget


@dataclass(frozen=True, slots=True)
class StackMutant:
    name: str
    bug: str
    expected_class: str
    layer: str  # "server": apply(StackTarget) on each app; "router": apply(Router)
    apply: Callable
    # text_model -> why the bug cannot show on this model's tokenizer (None: it can)
    not_applicable: Callable | None = None


def plant_server(target: StackTarget, seam: str, value) -> None:
    """Replace declared seam `seam` of one app's ServerState."""
    if seam not in SERVER_SEAMS:
        raise MissingSeam(f"{seam!r} is not a declared server seam (kvpage.server.seams)")
    replace(target.state, seam, value)


# --- server ------------------------------------------------------------------------------------
class _NoHoldBack(TextStream):
    def held_back(self, window: str) -> int:
        return 0  # nothing is kept for the next token: a stop string split across two is missed


def _stop_within_one_chunk(target: StackTarget) -> None:
    plant_server(target, "text_stream", _NoHoldBack)


class _KeepsStopString(TextStream):
    def stop_at(self, window: str) -> int | None:
        at = super().stop_at(window)
        if at is None:
            return None
        return at + max(len(s) for s in self.stop if window.startswith(s, at))  # kept in text


def _stop_string_kept(target: StackTarget) -> None:
    plant_server(target, "text_stream", _KeepsStopString)


class _CountsPendingBytes(TextStream):
    def offset_of(self, token_id: int) -> int:
        pending = len(self.detok.token_ids) > self.detok.read
        return super().offset_of(token_id) + int(pending and not self.stopped)


def _offset_off_by_one(target: StackTarget) -> None:
    plant_server(target, "text_stream", _CountsPendingBytes)


class _NoPromptContext(TextStream):
    def __post_init__(self) -> None:
        self.context = []  # the choice's text decoded as if it started a text of its own
        TextStream.__post_init__(self)


def _completion_without_prompt(target: StackTarget) -> None:
    plant_server(target, "text_stream", _NoPromptContext)


class _TokenCountOffsets(TextStream):
    def offset_of(self, token_id: int) -> int:
        return len(self.token_ids)  # the token's index: text_offset counted in tokens


def _offset_in_tokens(target: StackTarget) -> None:
    plant_server(target, "text_stream", _TokenCountOffsets)


class _EagerDetokenizer(Detokenizer):
    def still_arriving(self, text: str, end: int) -> bool:
        return False  # a byte of a character goes out at once, as U+FFFD


class _EagerBytes(TextStream):
    def __post_init__(self) -> None:
        TextStream.__post_init__(self)
        self.detok = _EagerDetokenizer.after(self.tokenizer, self.context)


def _byte_piece_early(target: StackTarget) -> None:
    plant_server(target, "text_stream", _EagerBytes)


def _without_prompt_not_applicable(text_model) -> str | None:
    """Only a tokenizer whose decoder spells the start of a text differently (SentencePiece's
    leading space) can show the bug."""
    spell = getattr(text_model, "spell", None)
    anchor = getattr(text_model, "anchor", None)
    if anchor is None or spell(anchor) == text_model.decode([anchor]):
        return "this tokenizer spells a token the same at the start of a text and inside it"
    return None


class _ClientSalt(Tenants):
    def cache_salt(self, tenant: str | None, requested: str | None) -> str | None:
        return requested  # the tenant's own salt is dropped: tenants share one namespace


def _salt_dropped(target: StackTarget) -> None:
    tenants = target.state.tenants
    plant_server(target, "tenants", _ClientSalt(dict(tenants.keys), tenants.secret))


def _switch_misses_namespace(target: StackTarget) -> None:
    def set_namespace_caching(self, cache_salt, enabled):
        LLMEngine.set_namespace_caching(self, None, enabled)  # always the unsalted namespace

    bind(target.engine, "set_namespace_caching", set_namespace_caching)


# --- router ------------------------------------------------------------------------------------
def _tenant_blind_tree(chunk: int, max_nodes: int) -> PrefixTree:
    tree = PrefixTree(chunk, max_nodes)
    match, insert = tree.match, tree.insert
    bind(tree, "match", lambda self, namespace, tokens: match("", tokens))
    bind(tree, "insert", lambda self, namespace, tokens: insert("", tokens))
    return tree


def _router_ignores_tenant(router: Router) -> None:
    replace(router, "tree_factory", _tenant_blind_tree)


def _first_use_tree(chunk: int, max_nodes: int) -> PrefixTree:
    """Recency is set when a prefix is first sent and never refreshed: FIFO, not LRU."""
    tree = PrefixTree(chunk, max_nodes)
    touch, seen = tree.touch, {}  # id -> node: held, so an id is never reused meanwhile

    def first_touch(self, path):
        touch([node for node in path if id(node) not in seen])
        seen.update((id(node), node) for node in path)

    bind(tree, "touch", first_touch)
    return tree


def _router_fifo_eviction(router: Router) -> None:
    replace(router, "tree_factory", _first_use_tree)


def _router_bound_off_by_one(router: Router) -> None:
    replace(router, "tree_factory", lambda chunk, max_nodes: PrefixTree(chunk, max_nodes + 1))


def _unreported_holds_everything(adapter, replicas, holdings) -> list[str]:
    """A replica that has not reported yet (Ray just started it) counts as holding every
    adapter: the replacement of a dead replica gets the adapter's requests before it has it."""
    return [r for r in replicas if r not in holdings or adapter in holdings[r].adapters]


def _router_routes_to_replica_without_adapter(router: Router) -> None:
    replace(router, "holders", _unreported_holds_everything)


STACK_MUTANTS: tuple[StackMutant, ...] = (
    StackMutant(
        "stop_string_within_one_chunk",
        "stop strings are looked for in each token's new text only, none held back",
        "server_text",
        "server",
        _stop_within_one_chunk,
    ),
    StackMutant(
        "stop_string_kept_in_text",
        "the text a stop string ends keeps the stop string (include_stop_str_in_output on)",
        "server_text",
        "server",
        _stop_string_kept,
    ),
    StackMutant(
        "text_offset_counts_pending_bytes",
        "text_offset is one too far while a multi-byte character is still arriving",
        "server_logprobs",
        "server",
        _offset_off_by_one,
    ),
    StackMutant(
        "text_offset_counted_in_tokens",
        "text_offset is the token's index in the choice, not the character its text starts at",
        "server_logprobs",
        "server",
        _offset_in_tokens,
    ),
    StackMutant(
        "byte_piece_sent_before_its_character",
        "a byte token goes out before the rest of its UTF-8 character has arrived: the text "
        "shows U+FFFD and then the character's remaining bytes, each as U+FFFD too",
        "server_text",
        "server",
        _byte_piece_early,
    ),
    StackMutant(
        "completion_decoded_without_prompt",
        "each choice's text is decoded without the prompt before it: a SentencePiece decoder "
        "drops the first completion token's leading space (Llama 2, Mistral)",
        "server_text",
        "server",
        _completion_without_prompt,
        _without_prompt_not_applicable,
    ),
    StackMutant(
        "tenant_salt_dropped",
        "the server keys requests by the client's salt, dropping the tenant's",
        "server_tenancy",
        "server",
        _salt_dropped,
    ),
    StackMutant(
        "namespace_switch_misses_its_namespace",
        "the per-tenant prefix-caching switch turns off the unsalted namespace instead",
        "server_admin",
        "server",
        _switch_misses_namespace,
    ),
    StackMutant(
        "router_ignores_tenant",
        "the router matches prefixes across namespaces (tenants)",
        "router_policy",
        "router",
        _router_ignores_tenant,
    ),
    StackMutant(
        "router_fifo_eviction",
        "the router's trees evict the oldest-inserted prefix, not the least recently used",
        "router_policy",
        "router",
        _router_fifo_eviction,
    ),
    StackMutant(
        "router_bound_off_by_one",
        "the router's trees hold one node more than their bound",
        "router_policy",
        "router",
        _router_bound_off_by_one,
    ),
    StackMutant(
        "router_sends_adapter_to_replica_without_it",
        "a replica that has not reported its adapters yet counts as holding every adapter: a "
        "request for an adapter is routed to a replica that lacks it",
        "router_adapter",
        "router",
        _router_routes_to_replica_without_adapter,
    ),
)
