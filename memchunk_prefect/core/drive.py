"""One loop that drives a map's state machine, whichever world carries out its instructions.

A *world* turns instructions into actions and tells what happened as events: the executor
(:class:`memchunk_prefect.run.executor.ChunkedMap`: Prefect task runs on a Dask cluster) and the simulator
(:mod:`memchunk_prefect.sim.runs`: a clock and sampled models) are the two. Both run this loop (the simulator
for several maps at once, each map's machine advanced, then handed its events), so a simulation replays exactly
what the runner would decide::

    execute(machine, world, machine.handle(Start(...)))
    drive(machine, world)

The loop alternates two calls of the machine (see :mod:`memchunk_prefect.core.machine`): ``advance``
(submit up to the in-flight cap, plan what is left, or finalize) and ``handle`` (an event). Instructions are
carried out in order; one that answers (reading completion markers, reading the workers' pauses) has its
answer handled at once, before the next instruction.

>>> import contextlib
>>> from memchunk_prefect.core.messages import Finalize
>>> class Done:
...     finished = False
...     def advance(self, at):
...         self.finished = True
...         return [Finalize(settle_runs=False)]
>>> class Log:
...     def __init__(self): self.seen = []
...     def now(self): return 0.0
...     def halted(self): return False
...     def carry_out(self, ins): self.seen.append(type(ins).__name__)
...     def next_events(self, machine): return None
...     def guard(self): return contextlib.nullcontext()
...     def handled(self): pass
>>> world = Log(); drive(Done(), world); world.seen
['Finalize']
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterable, Protocol, Sequence

from memchunk_prefect.core.messages import Event, Instruction


class Carrier(Protocol):
    """What carries out a map machine's instructions (:func:`execute` needs no more)."""

    def carry_out(self, instruction: Instruction) -> Event | None:
        """Do one instruction; an event it answers with (markers read, pauses read) goes back to the machine."""


class World(Carrier, Protocol):
    """What carries out a map machine's instructions and reports what happened."""

    def now(self) -> float:
        """Seconds since the epoch (a simulated clock in a simulation)."""

    def halted(self) -> bool:
        """True when the world stopped the map itself (a simulated failure); the loop ends."""

    def next_events(self, machine: Any) -> Sequence[Event] | None:
        """Wait for what happens next (a chunk ended, the slots changed...); None: stop driving; an empty
        sequence: nothing for the machine (it advances again).

        A world may raise to stop the map (the flow was interrupted, the upstream map failed)."""

    def guard(self) -> ContextManager[Any]:
        """Held while the machine changes (another thread may read its plan meanwhile)."""

    def handled(self) -> None:
        """Called after each batch of events was handled (wake whoever waits on this map)."""


def execute(machine: Any, world: Carrier, instructions: Iterable[Instruction]) -> None:
    """Carry out ``instructions`` in order; an answer is handled by the machine at once, and its own
    instructions carried out before the next."""
    for ins in instructions:
        answer = world.carry_out(ins)
        if answer is not None:
            execute(machine, world, machine.handle(answer))


def drive(machine: Any, world: World) -> None:
    """Run ``machine`` until it is finished, the world halts it, or the world has no more events."""
    while not machine.finished and not world.halted():
        with world.guard():
            execute(machine, world, machine.advance(world.now()))
        if machine.finished or world.halted():
            return
        events = world.next_events(machine)
        if events is None:
            return
        with world.guard():
            for event in events:
                execute(machine, world, machine.handle(event))
        world.handled()
