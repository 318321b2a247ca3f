"""The engine pool over in-process fake replicas (no Ray): routing, weights published once
per version, deaths failing attempts as infra, refit before work, and the pool giving up.
And the replica table's rules under arbitrary event sequences (hypothesis)."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollkeep.cluster.pool import EnginePool
from rollkeep.cluster.replicas import ReplicaGone, ReplicaInfo, ReplicaLost, ReplicaSet, State
from rollkeep.core.custody.trace_schema import EngineReplicaDied, EngineReplicaStarted
from rollkeep.core.rollout.generation import Completion, GenRequest, InfraError


def request(n: int) -> GenRequest:
    return GenRequest(group_id=f"g{n}", generation=0, attempt=0, prompt=None, seed=n,  # (the pool reads no prompt)
                      pinned_version=None)


class FakeReplica:
    """A replica whose process the test kills and lets come back; every call blocks until
    the test lets it go (`finish`) or kills the replica."""

    def __init__(self, index: int, *, can_restart: bool = True) -> None:
        self.index, self.can_restart = index, can_restart
        self.up = asyncio.Event()
        self.up.set()
        self.version = 0
        self.generated: list[tuple[str, int]] = []  # (group, weight version) of every call
        self._calls: dict[str, asyncio.Future] = {}
        self.incarnation = 0

    async def start(self) -> ReplicaInfo:
        await self.up.wait()
        if self.incarnation and not self.can_restart:
            raise ReplicaGone("restarts spent")
        self.incarnation += 1
        self.version, self.weights = 0, "initial"  # a new process: its engine's initial weights
        return ReplicaInfo(pid=100 + self.index, node="fake", continues=True)

    async def generate(self, req: GenRequest, progress) -> Completion:
        self.generated.append((req.group_id, self.version))
        done = self._calls[req.group_id] = asyncio.get_running_loop().create_future()
        await done
        return Completion(prompt_ids=np.zeros(1, np.int32), completion_ids=np.ones(3, np.int32),
                          logprobs=np.zeros(3, np.float32), versions=np.full(3, self.version, np.int32),
                          finish_reason="stop", text="111")

    def finish(self, group: str) -> None:
        self._calls.pop(group).set_result(None)

    def in_flight(self) -> int:
        return len(self._calls)

    async def refit(self, weights, version: int) -> None:
        if not self.up.is_set():
            raise ReplicaLost("dead")
        self.version, self.weights = version, weights

    def kill(self) -> None:
        self.up.clear()
        for f in self._calls.values():
            f.set_exception(ReplicaLost("killed"))
        self._calls.clear()

    async def close(self) -> None:
        pass


async def settle() -> None:
    for _ in range(20):  # let every ready task run (no time passes)
        await asyncio.sleep(0)


def make_pool(n: int, *, timeout: float = 60.0, max_restarts: int = 3, **kw):
    replicas = [FakeReplica(i, **kw) for i in range(n)]
    published: list[object] = []
    pool = EnginePool(replicas, publish=lambda w, v: published.append(w) or ("ref", len(published)),
                      max_restarts=max_restarts, replica_timeout_s=timeout)
    trace: list[object] = []
    unavailable: list[str] = []
    pool.attach(trace.append, unavailable.append)
    return pool, replicas, published, trace, unavailable


def test_attempts_go_to_the_replica_with_the_fewest_outstanding() -> None:
    async def main():
        pool, replicas, *_ = make_pool(3)
        await pool.open()
        tasks = [asyncio.ensure_future(pool.generate(request(i))) for i in range(7)]
        await settle()
        assert [r.in_flight() for r in replicas] == [3, 2, 2]
        replicas[1].finish("g1")
        replicas[1].finish("g4")
        await settle()
        t = asyncio.ensure_future(pool.generate(request(9)))
        await settle()
        assert [r.in_flight() for r in replicas] == [3, 1, 2]  # the emptiest one got it
        for r in replicas:
            for g in list(r._calls):
                r.finish(g)
        done = await asyncio.gather(*tasks, t)
        assert Counter(c.replica for c in done) == Counter({0: 3, 1: 3, 2: 2})
        await pool.close()

    asyncio.run(main())


def test_a_dead_replica_fails_its_attempts_as_infra_and_is_refit_before_it_gets_work() -> None:
    async def main():
        pool, replicas, published, trace, _ = make_pool(2)
        await pool.open()
        await pool.update_weights({"w": 1}, 1)
        assert published == [{"w": 1}] and [r.version for r in replicas] == [1, 1]
        tasks = [asyncio.ensure_future(pool.generate(request(i))) for i in range(4)]
        await settle()
        replicas[0].kill()
        results = await asyncio.gather(*tasks[0::2], return_exceptions=True)  # replica 0's two
        assert all(isinstance(e, InfraError) and e.replica == 0 for e in results)
        died = [x for x in trace if isinstance(x, EngineReplicaDied)]
        assert [(d.replica, d.attempts_failed, d.gone) for d in died] == [(0, 2, False)]
        # Weights move on while it is down: one publication, the live replica refits.
        await pool.update_weights({"w": 2}, 2)
        assert len(published) == 2 and replicas[1].version == 2
        # Everything goes to replica 1 meanwhile.
        t = asyncio.ensure_future(pool.generate(request(8)))
        await settle()
        assert replicas[1].in_flight() == 3 and replicas[0].in_flight() == 0
        replicas[0].up.set()  # Ray restarted its process (initial weights)
        await settle()
        back = [x for x in trace if isinstance(x, EngineReplicaStarted) and x.replica == 0]
        assert [b.restart for b in back] == [0, 1] and back[1].down_seconds is not None
        t2 = asyncio.ensure_future(pool.generate(request(9)))
        await settle()
        assert replicas[0].generated[-1] == ("g9", 2)  # refit to the current weights before work
        for r in replicas:
            for g in list(r._calls):
                r.finish(g)
        await asyncio.gather(*tasks[1::2], t, t2)
        await pool.close()

    asyncio.run(main())


def test_a_restarted_replica_is_refit_even_to_version_0() -> None:
    """Version 0 is the trainer's weights after the warm start, not the engine's initial ones."""

    async def main():
        pool, replicas, _, _, _ = make_pool(1)
        await pool.open()
        await pool.update_weights({"after": "warm start"}, 0)
        task = asyncio.ensure_future(pool.generate(request(0)))
        await settle()
        replicas[0].kill()
        with pytest.raises(InfraError):
            await task
        replicas[0].up.set()
        await settle()
        assert replicas[0].weights == ("ref", 1)  # the published version-0 weights, not its initial ones
        await pool.close()

    asyncio.run(main())


def test_a_replica_whose_restarts_are_spent_is_gone_and_with_none_left_the_pool_gives_up() -> None:
    async def main():
        pool, replicas, _, trace, unavailable = make_pool(1, max_restarts=0)
        await pool.open()
        task = asyncio.ensure_future(pool.generate(request(0)))
        await settle()
        replicas[0].kill()
        with pytest.raises(InfraError):
            await task
        await settle()
        assert [d.gone for d in trace if isinstance(d, EngineReplicaDied)] == [True]
        assert pool.replicas.state(0) is State.GONE
        assert unavailable and "gone" in unavailable[0]
        waiting = asyncio.ensure_future(pool.generate(request(1)))
        await settle()
        assert not waiting.done()  # no budget spent on nothing: the stop cancels it
        waiting.cancel()
        await pool.close()

    asyncio.run(main())


def test_with_no_replica_back_within_the_timeout_the_pool_says_so_once() -> None:
    async def main():
        pool, replicas, _, _, unavailable = make_pool(1, timeout=0.01)
        await pool.open()
        task = asyncio.ensure_future(pool.generate(request(0)))
        await settle()
        replicas[0].kill()  # and it never comes back
        with pytest.raises(InfraError):
            await task
        waiting = asyncio.ensure_future(pool.generate(request(1)))  # waits for a replica
        while not unavailable:
            await asyncio.sleep(0.005)  # the pool's own timeout decides when
        assert "cluster.replica_timeout_s" in unavailable[0] and len(unavailable) == 1
        assert not waiting.done()  # (the scheduler's deadline or the stop cancels it)
        waiting.cancel()
        await pool.close()

    asyncio.run(main())


def test_no_replica_that_can_start_is_an_error_at_open() -> None:
    class Broken(FakeReplica):
        async def start(self) -> ReplicaInfo:
            raise ReplicaGone("the engine failed to build: no such model")

    async def main():
        pool = EnginePool([Broken(0), Broken(1)], publish=lambda w, v: w, max_restarts=1, replica_timeout_s=5)
        with pytest.raises(ReplicaGone, match="failed to start"):
            await pool.open()
        await pool.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------- the table

EVENTS = st.lists(st.tuples(st.sampled_from(["start", "refit", "begin", "end", "die", "die_old"]),
                            st.integers(0, 2)), max_size=80)


@given(EVENTS, st.integers(0, 3))
def test_the_replica_table_routes_only_to_ready_replicas_and_counts_each_death_once(events, max_restarts) -> None:
    table = ReplicaSet(3, max_restarts=max_restarts)
    deaths = Counter()
    keys = 0
    for what, i in events:
        s = table.state(i)
        if what == "start" and s is State.STARTING:
            table.started(i)
        elif what == "refit" and s in (State.REFITTING, State.READY):
            table.refitted(i, 1)
        elif what == "begin" and (j := table.choose()) is not None:
            assert table.state(j) is State.READY
            loads = [len(table._r[k].outstanding) for k in table.ready()]
            assert len(table._r[j].outstanding) == min(loads)
            keys += 1
            table.begin(j, keys)
        elif what == "end" and table._r[i].outstanding:
            table.end(i, next(iter(table._r[i].outstanding)), 1)
        elif what in ("die", "die_old"):
            inc = table.incarnation(i) - (what == "die_old")
            death = table.died(i, inc, 0.0)
            if death is not None:
                deaths[i] += 1
                assert death.gone == (deaths[i] > max_restarts)
                assert table.died(i, inc, 0.0) is None  # its other attempts do not count it again
        assert table.live() == len(table.ready())
        for k in range(3):
            assert (table.state(k) is State.GONE) == (deaths[k] > max_restarts)
