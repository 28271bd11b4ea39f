"""The adapters the server's event-loop thread sees (ServerState.adapter_names / adapter_for)
come from the snapshot the engine thread publishes after each load and unload
(kvpage.lora.published), never from the engine's own registry."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kvpage import EngineConfig, LLMEngine, LoRARequest
from kvpage.server.state import ServerOptions, ServerState
from kvpage.verify.lora_adapters import LoraSpec, write_peft

MODEL = "builtin:tiny-llama"
SPECS = (LoraSpec("a", seed=1), LoraSpec("b", seed=2, targets=("q_proj", "v_proj")))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An engine with adapters, its written directories ((name, path) -> identity, the
    verifier's own hash of the files), and a ServerState reading it."""
    root = tmp_path_factory.mktemp("snapshot")
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=16, enable_lora=True, max_loras=2))
    model = engine.model.config
    written = [write_peft(s, model, root / f"{s.name}{s.seed}") for s in SPECS]
    reloaded = replace(SPECS[0], seed=3)  # "a" again, other weights, another directory
    written.append(write_peft(reloaded, model, root / "a3"))
    valid = {(w.spec.name, w.path): w.identity for w in written}
    state = _state(engine)
    return engine, [(w.spec.name, w.path) for w in written], valid, state


def _state(engine: LLMEngine) -> ServerState:
    """A ServerState over `engine` with none of a server's other parts (only its adapter
    reads are used here)."""
    parts = dict(metrics=None, audit=None, tenants=None, shadow=None, chat_template=None)
    return ServerState(ServerOptions(model_name="base"), SimpleNamespace(engine=engine), **parts)


def test_readers_use_the_published_snapshot_not_the_registry(served):
    engine, loads, _, state = served
    slots = engine.lora_slots
    name, path = loads[0]
    engine.load_lora_adapter(LoRARequest(name, path), True)
    published = slots.published
    assert state.adapters() is published
    assert state.adapter_names == tuple(sorted(slots.registered))
    registry, slots.registered = slots.registered, _Poisoned()  # walked: fails here
    try:
        assert state.adapter_names == published.names
        assert state.adapter_for(name) == LoRARequest(name, path)
        assert state.adapter_for("base") is None and state.adapter_for("nope") is None
    finally:
        slots.registered = registry
    engine.unload_lora_adapter(name)
    assert slots.published.version == published.version + 1
    assert name not in state.adapter_names and state.adapter_for(name) is None
    assert name in published.names  # a snapshot taken earlier never changes


class _Poisoned:
    """A registry no one may read."""

    def _read(self, *_):
        raise AssertionError("the engine's registry was read off the engine thread")

    __getattr__ = __iter__ = __contains__ = __getitem__ = __len__ = _read


def test_readers_only_ever_see_published_snapshots(served):
    """The engine thread loads, reloads and unloads in a loop, logging each snapshot as it
    publishes it; a reader thread meanwhile reads through ServerState. Every snapshot the
    reader saw is one the engine thread published, as it was published; each adapter's path
    and identity belong together (the files at that path hash to that identity); versions
    never go back; the names agree with the entries."""
    engine, loads, valid, state = served
    slots = engine.lora_slots
    log = {slots.published.version: _entries(slots.published)}  # version -> as published
    seen: list[tuple[int, tuple]] = []
    problems: list[str] = []
    done = threading.Event()

    def engine_thread() -> None:
        try:
            for i in range(60):
                name, path = loads[i % len(loads)]
                engine.load_lora_adapter(LoRARequest(name, path), True)
                log[slots.published.version] = _entries(slots.published)
                if i % 3 == 2:
                    engine.unload_lora_adapter(name)
                    log[slots.published.version] = _entries(slots.published)
        finally:
            done.set()

    def reader_thread() -> None:
        last = -1
        while not done.is_set() or len(seen) < 200:
            snapshot = state.adapters()
            entries = _entries(snapshot)
            seen.append((snapshot.version, entries))
            if snapshot.version < last:
                problems.append(f"version {snapshot.version} after {last}")
            last = snapshot.version
            if snapshot.names != tuple(sorted(e[0] for e in entries)):
                problems.append(f"names {snapshot.names} for entries {entries}")
            for name, path, identity in entries:
                if valid.get((name, path)) != identity:
                    problems.append(f"{name} at {path} with identity {identity[:24]}")
            for name in state.adapter_names:  # what a request's `model` resolves to
                got = state.adapter_for(name)
                if got is not None and (got.lora_name, got.lora_path) not in valid:
                    problems.append(f"adapter_for({name!r}) = {got}")

    threads = [threading.Thread(target=engine_thread), threading.Thread(target=reader_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert problems == []
    assert len(log) == 81  # as it was, then 60 loads and 20 unloads: one publication each
    for version, entries in seen:
        assert log.get(version) == entries, version
    assert len({v for v, _ in seen}) > 1  # the reader saw the engine thread's changes


def _entries(snapshot) -> tuple:
    return tuple((a.name, a.path, a.identity) for a in snapshot.by_name.values())
