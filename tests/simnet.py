"""A simulated network for the overlay (tests and benchmarks): many `otela_node.Overlay`
members in one process, a fake clock, loss, delay, partitions. Overlay is pure (no I/O), so
the same code that runs in `otela_node.py start` runs here, message for message."""
from __future__ import annotations

import collections
import heapq
import math
import os
import random
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import crdt  # noqa: E402
import otela_node as on  # noqa: E402


class SimulatedNetwork:
    """Runs Overlay members in one process. Messages are not sealed (the Wire is tested on its
    own); their size is counted as the JSON body plus the envelope."""

    def __init__(self, seed: int = 0, loss: float = 0.0, delay: Tuple[float, float] = (0.0002, 0.002),
                 config: Optional[on.Config] = None, start: float = 1_700_000_000.0):
        self.rng = random.Random(seed)
        self.loss = loss
        self.delay = delay
        self.config = config or on.Config(key=b"k" * 32)
        self.now = start
        self.members: Dict[str, on.Overlay] = {}      # gossip address -> member
        self.slow: Dict[str, Tuple[float, float]] = {}   # address -> extra delay of what it receives
        self.dead: set = set()
        self.partitions: List[Tuple[set, set]] = []
        self.queue: list = []                      # (time, n, dst, msg, src, tcp)
        self.wakeups: list = []                    # (time, address) of member timers
        self._n = 0
        self.bytes_sent = collections.Counter()    # address -> bytes
        self.changes: List[Tuple[float, str, str, Optional[dict]]] = []  # (time, at, sid, record)

    def add(self, bootstrap: Optional[List[str]] = None, addr: Optional[str] = None,
            config: Optional[on.Config] = None, **fields) -> on.Overlay:
        """A new member (at `addr`: a restart of the process that was there); `config`: its own
        (an ingress with the ingress tier's secret), else the network's."""
        if addr is None:
            addr = f"10.0.{len(self.members) // 250}.{len(self.members) % 250 + 1}:7946"
        self.dead.discard(addr)
        record = {"owner": "sim@" + addr, "state": crdt.SERVING, "version": 0, "started": self.now,
                  "role": "worker", "gossip": addr, "addr": addr.replace("7946", "7700")}
        record.update(fields)
        member = on.Overlay(config or self.config, f"{self.rng.getrandbits(128):032x}", record, self.now,
                         rng=random.Random(self.rng.random()))
        member.listeners.append(lambda sid, rec, at=addr: self.changes.append((self.now, at, sid, rec)))
        self.members[addr] = member
        self.send(addr, member.join(bootstrap or [], self.now))
        return member

    def kill(self, addr: str) -> None:
        self.dead.add(addr)

    def partition(self, side_a, side_b) -> None:
        self.partitions.append((set(side_a), set(side_b)))

    def heal(self) -> None:
        self.partitions = []

    def _blocked(self, src: str, dst: str) -> bool:
        return any((src in a and dst in b) or (src in b and dst in a) for a, b in self.partitions)

    def send(self, src: str, outs: List[on.Out]) -> None:
        for o in outs:
            size = len(crdt.dumps(o.msg)) + on.ENVELOPE
            self.bytes_sent[src] += size
            if o.addr in self.dead or o.addr not in self.members or self._blocked(src, o.addr):
                continue
            if not o.tcp and self.rng.random() < self.loss:
                continue                            # TCP retransmits; only datagrams get lost
            self._n += 1
            at = self.now + self.rng.uniform(*self.delay)
            if o.addr in self.slow:                 # a lagging member reads its socket late
                at += self.rng.uniform(*self.slow[o.addr])
            heapq.heappush(self.queue, (at, self._n, o.addr, o.msg, src, o.tcp))
        member = self.members.get(src)
        if member is not None:
            heapq.heappush(self.wakeups, (member.next_wakeup(), src))

    def run(self, duration: float) -> None:
        """Advance the fake clock by `duration`, delivering messages and firing timers in order."""
        end = self.now + duration
        while True:
            while self.wakeups and (self.wakeups[0][1] in self.dead or
                                    self.wakeups[0][0] != self.members[self.wakeups[0][1]].next_wakeup()):
                heapq.heappop(self.wakeups)         # stale entry: that member's timer moved
            wake = self.wakeups[0] if self.wakeups else (math.inf, "")
            msg_at = self.queue[0][0] if self.queue else math.inf
            t = min(wake[0], msg_at)
            if t > end:
                self.now = end
                return
            self.now = max(self.now, t)
            if msg_at <= wake[0]:
                _, _, dst, msg, src, tcp = heapq.heappop(self.queue)
                if dst not in self.dead:
                    self.send(dst, self.members[dst].receive(msg, src, self.now, tcp))
            else:
                heapq.heappop(self.wakeups)
                self.send(wake[1], self.members[wake[1]].tick(self.now))

    def live(self) -> List[on.Overlay]:
        return [m for a, m in self.members.items() if a not in self.dead]
