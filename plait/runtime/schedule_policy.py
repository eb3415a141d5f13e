"""Which waiting requests join the next prefill batch, and in what order.

Priority first: a request's tier is its `priority` (higher sooner) plus one for every
PRIORITY_AGING_S seconds it has waited, so starvation is bounded: a request of priority p
is ordered ahead of every request of priority <= q that arrived (q - p + 1) * PRIORITY_AGING_S
seconds or more after it; a stream of higher-priority work can delay it only by that window
(and the service of what arrived within it). Within a tier the policy orders: lpm (longest prefix
match first) keeps shared prefixes hot; fcfs serves in arrival order. Policies are registered
in plait.registry.SCHEDULE_POLICIES (the --schedule-policy choices). Retraction (KV pressure)
takes the lowest priority first.
Admission respects the prefill token budget (chunking the last request if needed), the
running-request cap, and the KV memory reserved for the decode steps of running requests.
While a long prompt prefills chunk by chunk, part of each step's budget goes to waiting
requests that fit in it whole (--chunked-prefill-new-share), so a short request does not wait
for the long prompt's last chunk.
A request whose prompt shares a long uncached prefix with one already in the batch waits one
step, so that prefix is computed once and then hit in the cache (in-batch prefix sharing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from plait.registry import SCHEDULE_POLICIES
from plait.runtime.core import Req
from plait.runtime.kv_manager import KVManager

# beyond this many waiting requests lpm costs more than it saves; fall back to fcfs
LPM_MAX_WAITING = 256
# defer a request sharing at least this many uncached prompt tokens with one in the batch (it
# waits one step and then reads them from the cache). 16: a chat template's default system
# prompt is shared by every request of a burst (SmolLM2's: 26 of the json workload's ~51
# tokens); at 32 none of it was reused and the benchmark's json workload ran 1.27x slower
# (32 requests: 812 of 1,644 prompt tokens cached at 16, none at 32; A/B in one process)
IN_BATCH_SHARE_MIN = 16
# decode tokens reserved per running request are capped at this
RESERVE_CAP = 256
# a waiting request's priority tier rises by one every this many seconds (starvation bound)
PRIORITY_AGING_S = 10.0


@dataclass
class NewTokenRatio:
    """Fraction of running requests' remaining max_new_tokens kept free for their decodes;
    raised after a retraction, decayed while decoding goes well (as SGLang does)."""

    value: float = 0.5
    floor: float = 0.1
    decay: float = 0.002

    def on_retract(self) -> None:
        self.value = min(1.0, self.value + 0.3)

    def on_decode(self) -> None:
        self.value = max(self.floor, self.value - self.decay)


@dataclass
class Admission:
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    chunked: Req | None = None  # the request whose prompt continues in a later step


def priority_tier(req: Req, now: float) -> int:
    """req.priority raised by one per PRIORITY_AGING_S seconds waited (the starvation bound)."""
    return req.priority + int(max(0.0, now - req.arrival_time) / PRIORITY_AGING_S)


def order_waiting(waiting: list[Req], policy: str, kv: KVManager) -> list[Req]:
    """The waiting requests in admission order: by priority tier, then by `policy`."""
    order = SCHEDULE_POLICIES.load(policy)
    now = time.monotonic()
    tiers = {id(r): priority_tier(r, now) for r in waiting}
    if len(set(tiers.values())) == 1:  # the common case: one tier
        return order(waiting, kv)
    by_tier = sorted(waiting, key=lambda r: -tiers[id(r)])  # stable: arrival order kept
    out: list[Req] = []
    start = 0
    for end in range(1, len(by_tier) + 1):
        if end == len(by_tier) or tiers[id(by_tier[end])] != tiers[id(by_tier[start])]:
            out += order(by_tier[start:end], kv)
            start = end
    return out


def order_fcfs(waiting: list[Req], kv: KVManager) -> list[Req]:
    return list(waiting)


def order_lpm(waiting: list[Req], kv: KVManager) -> list[Req]:
    if len(waiting) > LPM_MAX_WAITING or kv.cache.disable:
        return list(waiting)
    lens = {id(r): kv.match(r) for r in waiting}
    return sorted(waiting, key=lambda r: -lens[id(r)])  # stable: ties stay in arrival order


def retraction_victim(running: list[Req]) -> Req:
    """The request to send back to the queue under KV pressure: the lowest priority, then the
    least progress (the least work lost), then the latest arrival."""
    return min(running, key=lambda r: (r.priority, len(r.output_ids), -r.arrival_time))


def decode_reserve(running: list[Req], ratio: float) -> int:
    return int(sum(min(r.remaining_new_tokens, RESERVE_CAP) for r in running) * ratio)


def admit(
    ordered: list[Req],
    kv: KVManager,
    budget: int,
    max_new_reqs: int,
    reserve: int,
    beside: Req | None = None,
    chunk_cap: Callable[[Req], int] | None = None,
) -> Admission:
    """Admit requests from `ordered` (KV locked and allocated) until a limit is reached.
    `beside`: a long prompt's chunk in the same forward, to be continued after it: then only
    requests whose whole extend fits are admitted (the others wait for its last chunk), and
    none that shares an uncached prefix with it. `chunk_cap(req)`: the most tokens one
    forward may extend req by (Scheduler._chunk_limit)."""
    out = Admission()
    for req in ordered:
        if budget <= 0 or len(out.reqs) >= max_new_reqs:
            break
        if _shares_with_batch(req, out.reqs if beside is None else [beside, *out.reqs], kv):
            continue
        if not kv.admit(req):
            break
        ext = req.pending_len
        chunk = min(ext, budget, chunk_cap(req) if chunk_cap is not None else ext)
        if beside is not None and chunk < ext:
            kv.release(req)
            continue
        own_reserve = min(req.remaining_new_tokens, RESERVE_CAP) if chunk == ext else 0
        if kv.available < chunk + reserve + own_reserve or not kv.alloc(req, chunk):
            kv.release(req)
            break
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = req.kv_len
            req.queue_time = time.monotonic() - req.arrival_time
        reserve += own_reserve
        out.reqs.append(req)
        out.extend_lens.append(chunk)
        budget -= chunk
        if chunk < ext:
            out.chunked = req
            break
    return out


def _shares_with_batch(req: Req, batch: list[Req], kv: KVManager) -> bool:
    """req shares at least IN_BATCH_SHARE_MIN tokens past its cached prefix with a request of
    the batch: their first cached + IN_BATCH_SHARE_MIN tokens are equal, compared as one slice
    each (the judge workload's 64 requests on a 1,000-token rubric: walking whole common
    prefixes took 175 ms of a 0.97 s cached run)."""
    if kv.cache.disable or not batch:
        return False
    need = kv.match(req) + IN_BATCH_SHARE_MIN
    ids = req.all_ids
    if len(ids) < need:
        return False
    head = ids[:need]
    for other in batch:
        o = other.all_ids
        if len(o) >= need and o[:need] == head:
            return True
    return False
