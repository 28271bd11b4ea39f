"""The application's record of the LoRA adapters loaded and unloaded at run time, which a replica
Ray starts later (to replace a dead one) replays before it serves.

Where the record lives, and why there: a named, detached Ray actor per application
(`AdapterRecord`, named after the application in namespace `kvpage-adapters`), not the ingress.
The ingress is a replica Ray may replace too, and a replaced ingress starts empty: a record kept
in it would vanish with it, and every engine replica started after that would come up without
the adapters. A detached actor belongs to no replica, so neither an engine replica's death nor
the ingress's takes it down; both reach it by name (`open_record`, which creates it if it is
not there yet), so nothing has to hand a handle around, and a new ingress finds the old record.
`ray_serve.start` drops a stale record of the same name before it deploys (a fresh deployment
starts with no run-time adapters, as a fresh single server does) and `ray_serve.stop` drops it
with the application. What the record does not survive: its own actor's death (a node lost);
a new one starts empty, and replicas started after that lack the adapters loaded before. They
are never sent those adapters' requests (the router filters by what each replica holds), so
the loss shows as a 503 naming the adapter, not as a wrong answer.

What is recorded: after a load broadcast to every live replica succeeds on all of them, the
adapter's name and directory (a reload moves it to the end: entries keep load order); after an
unload succeeds on any, a tombstone under the name, so an adapter given by --lora-modules that
an operator unloaded is unloaded again on a new replica instead of coming back with it. Only
what the replicas accepted is recorded: a request the replicas refuse (no admin token, a bad
directory) never reaches the record.

A replica that starts while a load is broadcast: it reads the record again at the end of its
replay for as long as the record changes, and the ingress sends a recorded load or unload to any
replica the router lists that the broadcast did not reach. What is left is a replica that read
the record before the change and goes live only after that check: it lacks the adapter, says so
in its holdings, and is never sent the adapter's requests."""

from __future__ import annotations

import contextlib
import time

import ray
from ray.exceptions import RayActorError

NAMESPACE = "kvpage-adapters"
_GONE_S = 60.0  # how long a killed record may take to free its name


@ray.remote(num_cpus=0)
class AdapterRecord:
    """name -> PEFT directory (None: unloaded), in the order the operations happened."""

    def __init__(self) -> None:
        self.state: dict[str, str | None] = {}

    def loaded(self, name: str, path: str) -> None:
        self.state.pop(name, None)
        self.state[name] = path

    def unloaded(self, name: str) -> None:
        self.state.pop(name, None)
        self.state[name] = None

    def entries(self) -> list[tuple[str, str | None]]:
        return list(self.state.items())

    def loaded_names(self) -> list[str]:
        return [name for name, path in self.state.items() if path is not None]


def open_record(app_name: str):
    """The application's record (created here if it does not exist yet)."""
    return AdapterRecord.options(
        name=app_name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote()


def drop_record(app_name: str) -> None:
    """Remove the application's record, if any (a fresh deployment starts with none); returns
    once its name is free, so the next `open_record` makes a new one."""
    with contextlib.suppress(ValueError):  # none by that name
        ray.kill(ray.get_actor(app_name, namespace=NAMESPACE), no_restart=True)
    deadline = time.monotonic() + _GONE_S
    while time.monotonic() < deadline:
        try:
            ray.get_actor(app_name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)  # polling the name's release, bounded by the deadline


class RecordClient:
    """The record as an application process uses it: a call that finds the actor dead opens
    the record again (a new, empty one) and retries once."""

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self.actor = open_record(app_name)

    async def call(self, method: str, *args):
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayActorError:
            self.actor = open_record(self.app_name)
            return await getattr(self.actor, method).remote(*args)
