"""The decode fast path, derived from the module forward: a decode step's native kernel calls,
recorded once per row count and replayed.

Why: at batch 1 a small model's decode step spends a quarter of its time in Python between the
kernels (module calls, views, argument checks). The layers' forward is already the bound
kernels and views only (kvpage.model.llama: (hidden, residual) with the residual adds fused
into the norms), so one step of it is a fixed list of kernel calls on addresses: the decoder
layer exists once, and the fast path is that list.

Recording (`Tape.record`): the model's layers and final norm run once on the tape's own input
tensors (the embedded rows, the rotary tables, the slots, block tables at a fixed capacity,
lengths and window starts), each kernel call appended as (entry point, arguments) by
kvpage.model.native_build.call. A kernel with no native entry point (oneDNN's GEMM at the rows
above the weight GEMV's, the widened tiles) writes into a buffer through the same call while
recording (kvpage.model.linear_kernels), so it is a recorded call too. A TorchDispatchMode
watches the step: any other torch operator that computes data (not a view or an allocation)
would be left out of the replay, so the tape is refused and that row count keeps the module
forward (`foreign` says which operators). Every tensor the step allocated is kept by the tape:
the recorded addresses stay valid.

Replay (`Tape.replay`): the step's inputs are copied into the tape's (the block tables,
slots and lengths checked as the module forward checks them), then the calls run in order:
each run of native calls whose signatures it knows from one native call (native/tape_replay.cpp:
a switch over the kernels' signatures), the others from Python between them.
The recording step's own result is the module forward's, computed on the same inputs.

`DecodeTape.takes(x, attn)` says per step whether it runs: a decode-only paged step (KV in one
group or in layer groups), the pool in the model's dtype, adapter rows only with their
mask built (kvpage.lora.apply), no module hooks, no autograd.
finalize (kvpage.model.kernels) builds it with every fast path on ("decode_plan"), and again
when the weights change."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kvpage.model.native_attention as native_attention
import kvpage.model.native_build as native_build
import kvpage.model.native_small_ops as native_small_ops
from kvpage.model.paged_attention import GroupedAttention, PagedAttention, PagedAttentionMetadata

SOURCE = Path(__file__).parent / "native" / "tape_replay.cpp"
# A kernel's argument types, one letter each (int, int64, address, float) -> the replay's kind.
SIGNATURES = {
    "iplplpfllppi": 0,  # rms_norm
    "ipllpllllppli": 1,  # rotary
    "ippllpli": 2,  # silu_mul
    "ppllpi": 3,  # a linear kernel: weight GEMV, AMX
    "iplpplllpppplllllllfpli": 4,  # paged_decode
    "ipplpplllpllll": 5,  # paged_write
    "iplplppfllppi": 6,  # layer_norm
    "ipllpli": 7,  # gelu_new
}
_LETTERS = {ctypes.c_int: "i", ctypes.c_int64: "l", ctypes.c_void_p: "p", ctypes.c_float: "f"}


class _Call(ctypes.Structure):  # Call in tape_replay.cpp
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("kind", ctypes.c_int64),
        ("i", ctypes.c_int64 * 24),
        ("f", ctypes.c_float * 2),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_build.load(SOURCE, "the decode tape's replay", _bind)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kvpage_tape_call_bytes.restype = ctypes.c_int64
    if lib.kvpage_tape_call_bytes() != ctypes.sizeof(_Call):
        raise native_build.NativeBuildError("tape_replay.cpp's Call is not decode_tape._Call")
    lib.kvpage_tape_replay.restype = None
    lib.kvpage_tape_replay.argtypes = [ctypes.POINTER(_Call), ctypes.c_int64]
    return lib


def _letter(argtype) -> str | None:
    if argtype in _LETTERS:
        return _LETTERS[argtype]
    return "p" if issubclass(argtype, ctypes._Pointer) else None


def _native_call(fn, args: tuple) -> _Call | None:
    """One recorded call as the replay's struct, or None for a signature it does not know."""
    sig = "".join(_letter(t) or "?" for t in fn.argtypes or ())
    kind = SIGNATURES.get(sig)
    if kind is None or len(args) != len(sig):
        return None
    call = _Call(fn=ctypes.cast(fn, ctypes.c_void_p).value, kind=kind)
    ints, floats = [], []
    for letter, a in zip(sig, args, strict=True):
        if letter == "f":
            floats.append(a)
        elif isinstance(a, ctypes._Pointer):
            ints.append(ctypes.addressof(a.contents))
        else:
            ints.append(0 if a is None else int(a))
    call.i[: len(ints)] = ints
    call.f[: len(floats)] = floats
    return call


Program = list[Callable[[], object]]


def compile_calls(calls: list[tuple]) -> Program | None:
    """The calls as a program: each run of consecutive native calls whose signatures are in
    SIGNATURES as one kvpage_tape_replay over an array, every other call (a Python kernel, such
    as oneDNN's GEMM into a buffer) on its own between them; None where the replay is not
    built (the Python loop then runs them all)."""
    lib = _library()
    if lib is None:
        return None
    program: Program = []
    run: list[_Call] = []
    for fn, args in calls:
        native = _native_call(fn, args) if isinstance(fn, ctypes._CFuncPtr) else None
        if native is not None:
            run.append(native)
            continue
        program += _replay_of(lib, run)
        program.append(functools.partial(fn, *args))
        run = []
    return program + _replay_of(lib, run)


def _replay_of(lib: ctypes.CDLL, run: list[_Call]) -> Program:
    if not run:
        return []
    return [functools.partial(lib.kvpage_tape_replay, (_Call * len(run))(*run), len(run))]


ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "detach", "lift_fresh", "alias"})
QUERIES = frozenset({"size", "stride", "dim", "numel", "is_contiguous"})


def computes(func) -> bool:
    """Whether an aten operator writes data: not a view (each output aliases an input without
    writing it), an allocation or a metadata query."""
    name = func.overloadpacket.__name__
    if name in ALLOCATIONS or name in QUERIES or name.startswith("sym_"):
        return False
    returns = func._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write
                                for r in returns))  # fmt: skip


class _Guard(TorchDispatchMode):
    """Keeps every tensor the recorded step makes, and names the data-computing operators."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []
        self.foreign: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if computes(func) and not native_build.inside_call():  # a recorded call's own
            self.foreign.append(str(func))
        out = func(*args, **(kwargs or {}))
        if not native_build.inside_call():  # a recorded call's temporaries are made again
            self.kept += [t for t in (out if isinstance(out, tuple | list) else (out,))
                          if isinstance(t, torch.Tensor)]  # fmt: skip
        return out


class Tape:
    """One row count's recorded step: its inputs, the calls, what they write into."""

    def __init__(self, model: nn.Module, x: torch.Tensor, rope, attn, cap: int):
        m, dtype = x.shape[0], x.dtype
        self.capacity = cap  # block table width
        self.x = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.rope = _fresh(rope)  # as the layers take it: (cos, sin), or one per kind of layer
        cfg = model.config
        self.q = torch.empty(m, cfg.num_heads, cfg.head_dim, dtype=dtype)  # (M, H, D) a q's shape
        real = _backends(attn)
        metas = [_meta(m, cap) for _ in real]
        if type(attn) is GroupedAttention:  # KV in layer groups: one view per group
            metas[0].groups, metas[0].layer_map = metas[1:], attn.layer_map
            self.attn = GroupedAttention(real[0].storage, metas[0])
        else:
            self.attn = PagedAttention(real[0].storage, metas[0])
        self.backends = _backends(self.attn)
        for mine, theirs in zip(self.backends, real, strict=True):
            mine.native_allowed = theirs.native_allowed
        self.natives = [b.native_decode(self.q) for b in self.backends]
        self.windows = sorted({w for i in range(cfg.num_layers) if (w := cfg.window_of(i))})
        self.calls: list[tuple] = []
        self.program: Program | None = None  # the calls, native runs each one native call
        native = all(n is not None for n in self.natives)
        self.foreign: list[str] = [] if native else ["no native paged decode"]
        self.out: torch.Tensor | None = None
        self._kept: list[torch.Tensor] = []

    def load(self, x: torch.Tensor, rope, attn) -> None:
        """The step's inputs into the tape's, checked as the module forward checks them."""
        if self.foreign:
            return
        self.x.copy_(x)
        for mine, theirs in zip(_tensors(self.rope), _tensors(rope), strict=True):
            mine.copy_(theirs)
        for mine, theirs, native in zip(self.backends, _backends(attn), self.natives, strict=True):
            meta, storage = theirs.meta, theirs.storage
            theirs.native_decode(self.q)  # checks the block tables and lengths
            native_attention.check_slots(meta.slot_mapping, storage.num_blocks, storage.block_size)
            mine.meta.slot_mapping.copy_(meta.slot_mapping)
            native.tables[:, : meta.decode_tables.shape[1]].copy_(meta.decode_tables)
            native.lens.copy_(meta.decode_lens)
            for w in self.windows:
                torch.sub(native.lens, w, out=mine.window_starts(native, w)).clamp_(min=0)

    def record(self, model: nn.Module) -> torch.Tensor | None:
        """Run the layers once on the tape's inputs, recording; returns the step's hidden rows
        (refused or not: they are the module forward's)."""
        if self.foreign:
            return None
        for backend in self.backends:
            backend.prepare_write(self.x.dtype)
        guard = _Guard()
        with native_build.recording(self.calls), guard:
            self.out = layers_forward(model, self.x, self.rope, self.attn)
        self.foreign, self._kept = guard.foreign, guard.kept
        return self.out

    def compile(self) -> None:
        """The recorded calls as a program (native runs each one native call)."""
        self.program = compile_calls(self.calls)

    def replay(self) -> torch.Tensor:
        if self.program is not None:
            for step in self.program:
                step()
        else:
            for fn, args in self.calls:
                fn(*args)
        return self.out.clone()


def _fresh(rope):
    """Empty tensors nested as `rope`: a (cos, sin) pair, or a tuple of pairs (Gemma 3's
    global and local tables)."""
    if isinstance(rope, torch.Tensor):
        return torch.empty(rope.shape, dtype=rope.dtype)
    return tuple(_fresh(r) for r in rope)


def _tensors(rope) -> list[torch.Tensor]:
    return [rope] if isinstance(rope, torch.Tensor) else [t for r in rope for t in _tensors(r)]


def layers_forward(model: nn.Module, x: torch.Tensor, rope, attn) -> torch.Tensor:
    """The module forward of a model's decoder (`model.model`: `layers` taking (hidden,
    residual, rope, attn), then `norm`) on its embedded rows x: the final norm's rows."""
    hidden, residual = x, None
    for layer in model.model.layers:
        hidden, residual = layer(hidden, residual, rope, attn)
    return model.model.norm.add_forward(residual, hidden)[1]


def decoder_forward(model: nn.Module, x: torch.Tensor, rope, attn) -> torch.Tensor:
    """The decoder on x (N, C) -> (N, C): replayed from the model's tape where it takes the
    step (`model.decode_plan()`), else the module forward."""
    plan = model.decode_plan()
    if plan is not None and plan.takes(x, attn):
        hidden = plan.run(x, rope, attn)
        if hidden is not None:
            return hidden
    return layers_forward(model, x, rope, attn)


def _backends(attn) -> list[PagedAttention]:
    return attn.backends if type(attn) is GroupedAttention else [attn]


def _meta(m: int, cap: int) -> PagedAttentionMetadata:
    """A decode-only step's metadata on tensors a tape owns: slots, block tables, lengths."""
    return PagedAttentionMetadata(
        slot_mapping=torch.zeros(m, dtype=torch.int64),
        cu_seqlens_q=list(range(m + 1)),
        decode_rows=torch.arange(m),
        decode_tables=torch.zeros(m, cap, dtype=torch.int64),
        decode_mask=None,
        prefills=[],
        decode_only=True,
        decode_lens=torch.ones(m, dtype=torch.int64),
    )


MAX_TAPES = 8  # row counts kept (each keeps its step's activations), the least recent dropped


class DecodeTape:
    """A model's tapes, one per row count (and pool, threads, inference mode), recorded at the
    first decode step of that shape; a refused row count is remembered as None."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        modules = [m for m in model.model.modules()]
        self._hook_dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._lora = [m for m in modules if hasattr(m, "lora")]  # attention and MLP modules
        self._tapes: dict[tuple, Tape | None] = {}
        self.refused: dict[tuple, list[str]] = {}  # key -> the operators outside the kernels
        self.on = True  # off: the module forward (a mutant's switch)

    @property
    def kept(self) -> int:
        """Shapes this model keeps a tape (or a refusal) for: at most MAX_TAPES."""
        return len(self._tapes)

    @classmethod
    def build(cls, model: nn.Module) -> DecodeTape:
        """The tape of a model whose layers take (hidden, residual, rope, attn). A
        tensor-parallel shard's all-reduce is a recorded call (kvpage.parallel.sharding)."""
        return cls(model)

    def takes(self, x: torch.Tensor, attn: object) -> bool:
        """Whether this step can run on the tape (see the module docstring)."""
        if not self.on or type(attn) not in (PagedAttention, GroupedAttention):
            return False
        if torch.is_grad_enabled() or x.dim() != 2 or not native_small_ops.supports(x):
            return False
        for backend in _backends(attn):
            meta, storage = backend.meta, backend.storage
            if not meta.decode_only or meta.decode_lens is None or not backend.native_allowed:
                return False
            if not storage.use_native or storage.data.dtype != x.dtype:
                return False
        if self._hooked() or not self._replayable_adapters():
            return False
        return self._tapes.get(self._key(x, attn), True) is not None

    def run(self, x: torch.Tensor, rope, attn: PagedAttention) -> torch.Tensor | None:
        """x: (M, C) the embedded tokens, rope the rotary tables as the layers take them (a
        (cos, sin) pair, or a tuple of pairs) -> the final norm's hidden rows (M, C), or None
        where this row count's tape was refused (the module forward then runs)."""
        key = self._key(x, attn)
        tape = self._tapes.get(key)
        width = max(b.meta.decode_tables.shape[1] for b in _backends(attn))
        if tape is None or width > tape.capacity:
            tape = Tape(self.model, x, rope, attn, max(16, 1 << (width - 1).bit_length()))
            tape.load(x, rope, attn)
            out = tape.record(self.model)
            self._tapes.pop(key, None)
            if len(self._tapes) >= MAX_TAPES:
                del self._tapes[next(iter(self._tapes))]
            self._tapes[key] = None if tape.foreign else tape
            if tape.foreign:
                self.refused[key] = tape.foreign
            else:
                tape.compile()
            return None if out is None else out.clone()
        self._tapes[key] = self._tapes.pop(key)  # the most recent last
        tape.load(x, rope, attn)
        return tape.replay()

    def recorded(self) -> list[Tape]:
        """The tapes recorded so far (refused row counts have none)."""
        return [t for t in self._tapes.values() if t is not None]

    def _key(self, x: torch.Tensor, attn) -> tuple:
        data = _backends(attn)[0].storage.data
        mode = torch.is_inference_mode_enabled()
        threads = torch.get_num_threads()
        return (x.shape[0], x.dtype, data.data_ptr(), data.shape, threads, mode, self._adapters())

    def _hooked(self) -> bool:
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(self._hook_dicts)

    def _adapters(self) -> bool:
        """Whether the step has adapter rows: its tape records the LoRA deltas' calls (a
        tape of its row count without adapter rows has none)."""
        return any(m.lora is not None and m.lora.batch is not None for m in self._lora)

    def _replayable_adapters(self) -> bool:
        """No adapter rows, or their deltas recordable (kvpage.lora.apply: the mask built)."""
        contexts = {id(m.lora): m.lora for m in self._lora if m.lora is not None}
        return all(c.batch is None or c.replayable for c in contexts.values())
