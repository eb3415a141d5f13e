"""Per-request grammar state for the scheduler: compile off the loop, masks, jump-forward."""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from plait.args import ServerArgs
from plait.grammar.base import GrammarError, allocate_token_bitmask
from plait.runtime.core import ClosingPlan, Req, RequestFailed

logger = logging.getLogger(__name__)

# jump-forward leaves at most this many of its last tokens to the model (a longer token may
# span the end of the forced text)
JF_HOLD_BACK = 3
# start planning a closing once this few output tokens remain
CLOSE_WINDOW = 48
# ... or from the first token when the whole budget is this short: an output's first tokens
# choose its structure (`{"Records": [{` opens an item of many required keys), and by the
# time 48 tokens remain of 64 the shortest closing may no longer fit
CLOSE_WHOLE_BUDGET = 128
# grammar-state expansions one closing search may use
CLOSE_SEARCH_NODES = 600
# ... and one that looks for a closing shorter than the last plan, which still closes the
# output after the sampled token but no longer fits the budget (the token, a digit or a letter
# of a value, changed nothing the closing needs): such a search mostly finds nothing, and
# spent the whole budget proving it (2 ms a request on plait-tiny's JSON workload, where every
# answer meets its budget: a quarter of the workload's time)
CLOSE_SHORTER_NODES = 96
# what a token the matcher refuses at once costs of that budget (~1.4 us against ~10-30 us
# for a node taken: SmolLM2, a JSON schema): a path through a pattern's string (a phone
# number's digits and `-`, each found after the closers the matcher refuses) is affordable
CLOSE_REFUSED_COST = 0.125
# plan at every step once the last plan plus this slack no longer fits (a token may lengthen
# the closing by a few: `, "` opens a key that needs a value), else every this many steps
CLOSE_RECHECK_SLACK = 4
CLOSE_RECHECK_EVERY = 8
# a closing is searched this many tokens past the budget: its canonical tokens may be fewer
CLOSE_RESPELL_SLACK = 3
# iterative deepening (shortest plan) up to this depth, then one depth-first search
CLOSE_SHORTEST_DEPTH = 6
# closing plans kept by (constraint, output so far, search): a batch of requests under one
# schema starts from the same states (the first token, `{"age": -`: forced keys) and each
# searched the same plan again (0.5 ms at the first token on plait-tiny); kept for outputs
# of at most this many tokens, this many plans
PLAN_MEMO_OUTPUT = 32
PLAN_MEMO_SIZE = 512
# forced texts whose tokenization is kept (a schema's keys and punctuation: a handful of
# distinct strings, each encoded hundreds of times a batch)
FORCED_ENCODINGS = 4096
# the closing search tries the first tokens of at most this many of a JSON schema's required
# key names first where a key is spelled; they are kept for this many schemas (a schema's
# text is the key: a dev-set schema runs to 370 KB)
REQUIRED_KEY_TOKENS = 256
REQUIRED_KEY_SCHEMAS = 64
# short texts from which a closing is assembled (punctuation, minimal values)
# (tried in this order: compound closers, closers, separators, minimal values, then fillers
# that only extend a value; a filler before a separator would make the first plan found
# needlessly long, e.g. 0000... instead of ", ")
_CLOSER_TEXTS = ['"}', "]}", "}}", '"]', "0}", "0]", '"', "}", "]", ",", ":", '",', '":',
                 '""', "[]", "{}", "0", "null", "false", "true", "1", "a", " "]


def utf8_missing_bytes(text: bytes) -> int:
    """How many continuation bytes the last UTF-8 character of `text` still lacks (0 when it
    ends with a whole character, or with bytes that are not the start of one)."""
    for back in range(1, min(4, len(text)) + 1):
        c = text[-back]
        if c < 0x80:
            return 0
        if c >= 0xC0:  # the character's first byte: 110xxxxx, 1110xxxx or 11110xxx
            width = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return max(0, width - back)
    return 0


def _wordy(text: str) -> bool:
    return any(c.isalnum() or c == "_" for c in text)


def _accepts(m, token: int) -> bool:
    """Matcher m takes `token` next (m is left unchanged)."""
    if m.accept_prefix((token,)):
        m.rollback(1)
        return True
    return False


def _prefix_successor(prefix: bytes) -> bytes | None:
    """The least byte string greater than every string that starts with `prefix`: its last
    byte below 0xff incremented, what follows it dropped; None when there is none (the
    prefix is empty or all 0xff: every string after it has it as a prefix)."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes([head[-1] + 1]) if head else None


class ConstraintTracker:
    def __init__(self, args: ServerArgs, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._manager = None
        self._manager_lock = threading.Lock()  # (built by the loop or by prepare_in_background)
        self._pending: list[tuple[Req, Any]] = []
        self._closers: list[int] | None = None
        self._quotes: list[int] | None = None
        self._free_text: tuple[list[int], list[int]] | None = None
        self._chars: tuple[np.ndarray, list[str]] | None = None
        self._spelled = None
        self._spelling_thread: threading.Thread | None = None
        self._mask_scratch: torch.Tensor | None = None  # one row, for _allowed
        self._mask_words: np.ndarray | None = None  # its words, as a numpy view
        self._continuations: list[int] | None = None  # single-byte tokens 0x80-0xBF
        self._forced_ids: dict[str, tuple[int, ...]] = {}  # _encode_forced's memo
        # a JSON schema's required keys' first tokens (_required_key_tokens' memo), and those
        # of the request whose closing is being searched
        self._required_keys: dict[str, np.ndarray] = {}
        self._required_now: np.ndarray | None = None
        # _plan_after's memo: a matcher's state is its constraint's after the output's tokens
        self._plans: dict[tuple, tuple[int, ...] | None] = {}

    @property
    def manager(self):
        if self._manager is None:
            with self._manager_lock:
                if self._manager is None:
                    self._manager = self._make_manager()
                    self._prepare_spelling()
        return self._manager

    def prepare_in_background(self) -> None:
        """Build the grammar backend and the spelling index on a background thread (the
        scheduler calls this once it first idles), so the first constrained request does not
        wait for them: it took ~2.7 s more than the next one on SmolLM2 (importing the
        backend, its vocabulary tables, the first compile), ~1 s of it on the scheduler's loop,
        holding up every request in flight."""
        threading.Thread(target=self._prepare, name="plait-grammar-prepare", daemon=True).start()

    def _prepare(self) -> None:
        try:
            self.manager.backend  # noqa: B018 - waits for the backend's vocabulary tables
            self._spelling()
        except Exception:  # the first constrained request builds it again (or fails)
            logger.warning("preparing the grammar backend failed", exc_info=True)

    def _make_manager(self):
        from plait.grammar.manager import GrammarManager
        from plait.models.tokenizer import resolve_tokenizer

        return GrammarManager(
            self.args.grammar_backend,
            resolve_tokenizer(self.tokenizer),  # the backends take transformers' own
            self.vocab_size,
            self.eos_ids,
            compile_timeout=self.args.grammar_compile_timeout,
            cache_dir=self.args.grammar_cache_dir,
            isolation=self.args.grammar_isolation,
            any_whitespace=self.args.grammar_any_whitespace,
        )

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, req: Req) -> None:
        kind, spec = req.sampling.constraint
        self._pending.append((req, self.manager.submit(kind, spec)))

    def cancel(self, req: Req) -> None:
        self._pending = [(r, f) for r, f in self._pending if r is not req]

    def poll(self) -> list[tuple[Req, RequestFailed | None]]:
        """Requests whose compile finished: (req, None) with req.grammar set, or (req, error)."""
        done, still = [], []
        for req, fut in self._pending:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = fut.result().matcher()
                done.append((req, None))
            except GrammarError as e:  # the request's constraint: 400
                done.append((req, RequestFailed(str(e), 400, e.param)))
            except Exception as e:  # noqa: BLE001 - fails this request (500)
                done.append((req, RequestFailed(f"constraint: {type(e).__name__}: {e}", 500)))
        self._pending = still
        return done

    def stats(self) -> dict[str, Any]:
        return self._manager.stats() if self._manager is not None else {}

    def flush(self) -> None:
        """Forget the closing plans past requests searched (flush_cache: a benchmark's next
        repetition starts cold)."""
        self._plans.clear()

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()

    # ------------------------------------------------------------------ decoding
    def bitmask(
        self, reqs: list[Req], vocab: int, on_error: Callable[[Req, RequestFailed], None]
    ) -> torch.Tensor | None:
        """The batch's grammar masks [len(reqs), words]; a matcher that raises is reported to
        on_error (its row is left empty) and the other rows are filled."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        mask = allocate_token_bitmask(len(reqs), vocab)
        for i in rows:
            try:
                reqs[i].grammar.fill_bitmask(mask, i)
            except Exception as e:  # noqa: BLE001 - fails this request (500)
                on_error(reqs[i], RequestFailed(f"constraint: {type(e).__name__}: {e}", 500))
        return mask

    def valid_prefix(self, req: Req, tokens: list[int]) -> int:
        """How many leading `tokens` req's grammar accepts from its current state (which is
        left unchanged)."""
        n = req.grammar.accept_prefix(tokens)
        req.grammar.rollback(n)
        return n

    def takes(self, req: Req, token: int) -> bool:
        """Whether req's grammar accepts `token` now (its state left unchanged)."""
        m = req.grammar
        return m is None or m.is_terminated() or _accepts(m, token)

    def accept(self, req: Req, token: int) -> None:
        m = req.grammar
        if m is None:
            return
        if not m.accept_token(token):
            # cannot happen for masked sampling; a forced token mismatch is a bug worth surfacing
            raise RequestFailed(f"internal error: the constraint rejected token {token}", 500)
        if m.is_terminated():
            req.finish("stop", matched=token)

    def jump_forward(self, req: Req, limit: int) -> list[int]:
        """Tokens of the text the grammar forces next (canonically tokenized), already
        checked against the matcher (which is left unchanged). The last tokens are held back
        when the grammar allows a longer token that starts with their text: tokenized alone,
        forced text ends at a token boundary the model would not choose (`"items": [` forced
        as ` [` where the model takes ` ["`), which changes what it generates next.
        Off with --disable-jump-forward (the model then decodes every token under the mask);
        the scheduler sets `limit` (for a request that returns logprobs, see
        Scheduler._jump_limit)."""
        m = req.grammar
        if self.args.disable_jump_forward or m is None or m.is_terminated() or limit <= 0:
            return []
        text = m.find_jump_forward_string()
        if not text:
            return []
        ids = self._encode_forced(text)[:limit]
        accepted = m.accept_prefix(ids)
        ids = ids[:accepted]
        held, rolled = self._held_back(m, ids)
        if accepted - rolled:
            m.rollback(accepted - rolled)
        return ids[: accepted - held]

    def _encode_forced(self, text: str) -> list[int]:
        """The canonical tokens of forced text, memoized: jump-forward and the closing planner
        encode the same few strings (`", "tags": [`, `}`, ...) over and over. SmolLM2's JSON
        extraction batch made 414 encode calls of 7 distinct strings, 17 ms of its ~1.1 s."""
        ids = self._forced_ids.get(text)
        if ids is None:
            if len(self._forced_ids) >= FORCED_ENCODINGS:
                self._forced_ids.clear()
            ids = self._forced_ids[text] = tuple(
                self.tokenizer.encode(text, add_special_tokens=False))
        return list(ids)

    def _held_back(self, m, ids: list[int]) -> tuple[int, int]:
        """How many of the forced `ids` (all accepted by m) to leave to the model: the most,
        up to JF_HOLD_BACK, whose text a longer token allowed in their place starts with.
        Returns (held, rolled back from m here)."""
        held = rolled = 0
        for k in range(1, min(len(ids), JF_HOLD_BACK) + 1):
            m.rollback(1)
            rolled += 1
            if self._extension_allowed(m, ids[-k:]):
                held = k
        return held, rolled

    def _extension_allowed(self, m, tail: list[int]) -> bool:
        """The matcher allows a token whose text starts with the text of `tail` and is longer.
        The tokens with that prefix are one range of the spellings in sorted order (found by
        bisection); their bits are read from the matcher's mask in one gather. (A Python scan
        of the range cost ~3 ms a call where the prefix is one common byte such as `"`:
        thousands of tokens; SmolLM2's JSON workload spent ~10% of its wall time there.)"""
        spelled, (keys, ids) = self._spelling()
        parts = [spelled[t] for t in tail]
        if any(p is None for p in parts):
            return False
        text = b"".join(parts)
        lo = bisect.bisect_right(keys, text)  # longer tokens with this prefix sort after it
        successor = _prefix_successor(text)
        hi = len(keys) if successor is None else bisect.bisect_left(keys, successor)
        if hi <= lo:
            return False
        return bool(self._allowed(m, ids[lo:hi]).any())

    def _allowed(self, m, ids: np.ndarray) -> np.ndarray:
        """Which of the token `ids` (int64) matcher m allows next: 1 or 0 each."""
        if self._mask_scratch is None:
            self._mask_scratch = allocate_token_bitmask(1, self.vocab_size)
            # a view of its words: the gather below in numpy takes ~3 us, torch's index_select
            # and shifts took ~16 (SmolLM2's JSON extraction batch: ~500 calls)
            self._mask_words = self._mask_scratch[0].numpy()
        m.fill_bitmask(self._mask_scratch, 0)
        return (self._mask_words[ids >> 5] >> (ids & 31)) & 1

    def _prepare_spelling(self) -> None:
        """Build the spelling index (_spelling) in a background thread, started with the first
        constrained request: it takes ~0.4 s for SmolLM2's 49k tokens, which the scheduler
        loop would otherwise spend at once on the first hold-back check, holding up every
        request in flight. (Python work, so it shares the GIL with the loop, which spends
        most of a step in kernels that release it.)"""
        if self._spelled is not None:  # (the closing planner reads it with jump-forward off)
            return
        if self._spelling_thread is None:
            self._spelling_thread = threading.Thread(
                target=self._build_spelling, name="plait-spelling", daemon=True)
            self._spelling_thread.start()

    def _build_spelling(self) -> None:
        from plait.grammar.vocab import token_bytes

        spelled = token_bytes(self.tokenizer)[: self.vocab_size]
        pairs = sorted((b, i) for i, b in enumerate(spelled) if b)
        self._spelled = (spelled, ([b for b, _ in pairs],
                                   np.array([i for _, i in pairs], dtype=np.int64)))

    def _spelling(self):
        """Token bytes by id, and (sorted spellings, their ids as an int64 array) for prefix
        look-ups: from the background build when one ran, else built here."""
        if self._spelled is None:
            if self._spelling_thread is not None:
                self._spelling_thread.join()
            if self._spelled is None:  # no background build, or it failed: build (or raise) here
                self._build_spelling()
        return self._spelled

    # ------------------------------------------------------------------ budget
    # Near max_new_tokens a constrained output must still end whole (JSON that parses,
    # finish_reason "stop", not a truncation). The model keeps every token that leaves a
    # closing (the shortest token sequence that completes the constraint, then EOS) that
    # fits the budget after it; the first sampled token that leaves none is replaced by the
    # closing planned before it. So an answer that fits is never cut short (a fixed margin
    # forced closings a few tokens early: `1000400]` for the model's `10004000]`), and one
    # that does not fit still ends whole. Inside the window admit() checks every sampled
    # token: a few matcher steps when the plan before it still ends the output after it, else
    # a grammar search (bounded: CLOSE_SEARCH_NODES).

    def plan_closing(self, req: Req) -> None:
        """After an output token: (re)plan req's closing when the budget is getting tight by
        the last plan's length, or every few steps inside the window; kept in
        req.closing_plan for admit()."""
        m, remaining = req.grammar, req.remaining_new_tokens
        if m is None or m.is_terminated() or not self._in_window(req) or not self.eos_ids:
            return
        if m.can_terminate():  # what is written is whole: a cut there leaves it valid (a
            return  # structural tag's free text, a finished regex); nothing to close
        if self.current_plan(req) is not None:
            return  # admit() planned from this very point (or its plan's forced text came)
        last_len, last_at = req.closing_plan.length, req.closing_plan.remaining_then
        # after searches that found nothing, each waits twice as long as the last: a closing
        # the budget cannot hold (a minLength of 5000 under 48 tokens) was searched every 8
        # tokens and at each of the last 4, 14.7x an unconstrained token on plait-tiny
        failures = req.closing_plan.failures
        tight = last_len is not None and last_len >= 0 and (
            remaining <= last_len + 1 + CLOSE_RECHECK_SLACK)
        every = CLOSE_RECHECK_EVERY << min(max(failures - 1, 0), 4)
        if last_len is not None and not tight and last_at - remaining < every:
            return
        plan = self._plan_after(req, remaining - 1, self._shortest_first(req))
        self._keep_plan(req, plan, len(req.output_ids), remaining)

    def admit(self, req: Req, token: int) -> list[int] | None:
        """Before a sampled token is emitted: None to keep it, or the tokens to emit in its
        place (the closing planned before it, then EOS) when it would leave no closing that
        fits the budget. Inside the window every token is checked: the closing planned before
        it usually still ends the output after it (a letter of a value, a digit), which a few
        matcher steps confirm; else (punctuation, a key's name, a tight budget) a grammar
        search plans from after it. Either way that is the plan for the next token."""
        m = req.grammar
        if m is None or token in self.eos_ids:
            return None
        remaining = req.remaining_new_tokens  # before the token
        if not req.output_ids and req.closing_plan.length is None:
            self.plan_closing(req)  # a short budget from the first token on: plan from the start
        plan = self.current_plan(req)
        if plan is None:  # no plan from this point (jump-forward's text left the last one)
            if req.closing_plan.length in (None, -1) or not self._in_window(req):
                return None  # never planned, or nothing fitted then: nothing to keep to
        elif len(plan) + 1 > remaining:
            return None  # none fits (it was planned too late)
        elif plan and token == plan[0]:
            return None  # the model closes as planned
        if not m.accept_token(token):
            return None  # (the emit reports the grammar's refusal)
        try:
            if m.is_terminated() or (remaining == 1 and m.can_terminate()):
                return None  # whole after it (the budget's last token: it ends by length)
            ids = req.output_ids + [token]
            still = plan is not None and self._completes(m, plan)
            if still and len(plan) + 1 < remaining:
                self._keep_plan(req, plan, len(ids), remaining - 1)
                return None  # the same closing still fits after the token
            after = self._plan_after(req, remaining - 2, self._shortest_first(req), ids,
                                     CLOSE_SHORTER_NODES if still else CLOSE_SEARCH_NODES)
        finally:
            m.rollback(1)
        if after is not None:
            self._keep_plan(req, after, len(ids), remaining - 1)
            return None
        if plan is None:  # planned from before the token only now that it is needed
            plan = self._plan_after(req, remaining - 1, self._shortest_first(req))
            self._keep_plan(req, plan, len(req.output_ids), remaining)
            if plan is None:
                return None
        return plan + [self._accepted_eos(m, plan)]

    @staticmethod
    def _in_window(req: Req) -> bool:
        """Whether req's output tokens are checked against a closing now: its last
        CLOSE_WINDOW tokens, or all of them when its budget is at most CLOSE_WHOLE_BUDGET."""
        return (req.remaining_new_tokens <= CLOSE_WINDOW
                or req.sampling.max_new_tokens <= CLOSE_WHOLE_BUDGET)

    @staticmethod
    def _completes(m, plan: list[int]) -> bool:
        """Whether matcher m takes `plan` to a state that can end (m left unchanged)."""
        n = m.accept_prefix(plan)
        try:
            return n == len(plan) and m.can_terminate()
        finally:
            if n:
                m.rollback(n)

    def current_plan(self, req: Req) -> list[int] | None:
        """The rest of req's last plan from the end of its output: the plan was made there, or
        the tokens output since are its first ones (jump-forward forces the same text); else
        None."""
        cp = req.closing_plan
        if cp.tokens is None:
            return None
        k = len(req.output_ids) - cp.at
        if k < 0 or k > len(cp.tokens) or tuple(req.output_ids[cp.at:]) != cp.tokens[:k]:
            return None
        return list(cp.tokens[k:])

    def _keep_plan(self, req: Req, plan: list[int] | None, at: int, remaining: int) -> None:
        failures = 0 if plan is not None else req.closing_plan.failures + 1
        req.closing_plan = ClosingPlan(remaining, tuple(plan) if plan is not None else None, at,
                                       failures)

    @staticmethod
    def _shortest_first(req: Req) -> bool:
        """The shortest-first pass only pays when the last plan was short."""
        last_len = req.closing_plan.length
        return not last_len or last_len <= CLOSE_SHORTEST_DEPTH

    def _plan_after(self, req: Req, max_len: int, shortest: bool,
                    ids: list[int] | None = None,
                    nodes: int = CLOSE_SEARCH_NODES) -> list[int] | None:
        """_plan_closing from req's matcher, whose output so far is `ids` (req.output_ids by
        default). An output that ends inside a UTF-8 character (a byte-level token of its
        first bytes) completes it first: until then the grammar takes only continuation bytes,
        no quote and no closer, and a plan searched from there found nothing, so a string cut
        mid-character ran to the budget unclosed.
        Plans from an output of at most PLAN_MEMO_OUTPUT tokens are kept: the matcher's state
        is the constraint's after those tokens, so another request there gets the same plan."""
        if max_len < 0:
            return None
        ids = req.output_ids if ids is None else ids
        if len(ids) > PLAN_MEMO_OUTPUT:
            return self._search_after(req, max_len, shortest, ids, nodes)
        key = (req.sampling.constraint, tuple(ids), max_len, shortest, nodes)
        if key not in self._plans:
            if len(self._plans) >= PLAN_MEMO_SIZE:
                self._plans.clear()
            plan = self._search_after(req, max_len, shortest, ids, nodes)
            self._plans[key] = None if plan is None else tuple(plan)
        plan = self._plans[key]
        return None if plan is None else list(plan)

    def _search_after(self, req: Req, max_len: int, shortest: bool, ids: list[int],
                      nodes: int) -> list[int] | None:
        m = req.grammar
        head = self._complete_character(m, ids)
        if head is None:
            return None
        kind = req.sampling.constraint
        any_text = kind is not None and kind[0] in ("regex", "ebnf", "choices")
        self._required_now = self._required_key_tokens(kind)
        try:
            plan = None
            # searched a few tokens deeper first: respelled, a plan may come out shorter
            for depth in (max_len - len(head) + CLOSE_RESPELL_SLACK, max_len - len(head)):
                if depth >= 0:
                    plan = self._plan_closing(m, depth, shortest, any_text, nodes)
                if plan is not None:
                    plan = self._respelled(m, plan)
                    if len(head) + len(plan) <= max_len:
                        break
                    plan = None
        finally:
            m.rollback(len(head))
            self._required_now = None
        return None if plan is None else head + plan

    def _required_key_tokens(self, constraint: tuple[str, str] | None) -> np.ndarray | None:
        """The first tokens of the names a JSON schema lists as `required` anywhere (its
        objects' and its definitions'), for the closing search to try first where a key is
        spelled: the grammar takes a schema's optional keys in order before each required one
        (`badOutputUrl` before `database`), and a search that spelled the first allowed
        letter wrote every optional key and never reached the end (Snowplow's 14 required
        keys of 24: no closing found in 127 tokens, where one of 111 exists)."""
        if constraint is None or constraint[0] != "json_schema":
            return None
        spec = constraint[1]
        ids = self._required_keys.get(spec)
        if ids is None:
            names: set[str] = set()

            def walk(node: Any) -> None:
                if isinstance(node, dict):
                    req = node.get("required")
                    if isinstance(req, list):
                        names.update(n for n in req if isinstance(n, str) and n)
                    for v in node.values():
                        walk(v)
                elif isinstance(node, list):
                    for v in node:
                        walk(v)

            try:
                walk(json.loads(spec))
            except ValueError:
                pass
            first: list[int] = []
            for name in sorted(names):
                enc = self.tokenizer.encode(name, add_special_tokens=False)
                if enc and enc[0] not in first:
                    first.append(enc[0])
            if len(self._required_keys) >= REQUIRED_KEY_SCHEMAS:
                self._required_keys.clear()
            ids = self._required_keys[spec] = np.array(first[:REQUIRED_KEY_TOKENS], dtype=np.int64)
        return ids if len(ids) else None

    def _respelled(self, m, plan: list[int]) -> list[int]:
        """The plan's text in its canonical tokens when they are fewer and matcher m takes
        them to an end: the search joins forced text and closers token by token (` [` `]`),
        where the model writes one token (` []`), and a plan longer than the model's own way
        to the end replaced its last token when the budget fit that way exactly."""
        if len(plan) < 2:
            return plan
        spelled = self._spelling()[0]
        try:
            text = b"".join(spelled[t] for t in plan).decode("utf-8")
        except (TypeError, UnicodeDecodeError):  # (a token without bytes; a split character)
            return plan
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= len(plan):
            return plan
        return ids if self._completes(m, ids) else plan

    def _complete_character(self, m, output_ids: list[int]) -> list[int] | None:
        """The continuation-byte tokens that end a UTF-8 character left open at the end of
        output_ids (the lowest byte the grammar takes, each), left accepted by matcher m (the
        caller rolls them back); [] when none is open, None (nothing accepted) when the
        grammar takes none."""
        spelled = self._spelling()[0]
        tail = b"".join(spelled[t] or b"" for t in output_ids[-4:] if t < len(spelled))
        need = utf8_missing_bytes(tail)
        if not need:
            return []
        if self._continuations is None:
            self._continuations = [t for t, b in enumerate(spelled)
                                   if b is not None and len(b) == 1 and 0x80 <= b[0] <= 0xBF]
            self._continuations.sort(key=lambda t: spelled[t])
        head = []
        for _ in range(need):
            tok = next((t for t in self._continuations if m.accept_token(t)), None)
            if tok is None:
                break
            head.append(tok)
        if len(head) == need:
            return head
        m.rollback(len(head))
        return None

    def _accepted_eos(self, m, plan: list[int]) -> int:
        for tok in plan:
            m.accept_token(tok)
        try:
            for eos in self.eos_ids:
                if m.accept_token(eos):
                    m.rollback(1)
                    return eos
        finally:
            m.rollback(len(plan)) if plan else None
        return self.eos_ids[0]

    def _closer_ids(self) -> list[int]:
        if self._closers is None:
            ids = []
            for text in _CLOSER_TEXTS:
                enc = self.tokenizer.encode(text, add_special_tokens=False)
                if len(enc) == 1 and enc[0] not in ids:
                    ids.append(enc[0])
            self._closers = ids
        return self._closers

    def _free_text_closer_ids(self) -> tuple[list[int], list[int]]:
        """The closers spelled with a word character (`a`, `0`, `null`), and the others."""
        if self._free_text is None:
            closers = self._closer_ids()
            wordy = [_wordy(self.tokenizer.decode([t])) for t in closers]
            self._free_text = ([t for t, w in zip(closers, wordy) if w],
                               [t for t, w in zip(closers, wordy) if not w])
        return self._free_text

    def _other_characters(self, m, budget: list[float]) -> tuple[list[int], list[int]]:
        """For a constraint other than JSON (a regex, a grammar: the search's `any_text`), and
        for JSON where no closer leads on (a key the grammar does not force), the
        one-character tokens matcher m takes here that are no closer: word characters (one of
        each kind: a digit, an upper-case and a lower-case letter, `_`), and up to 6 others
        (`.`, `@`, `!`, a newline).
        The closers are JSON's punctuation; a regex such as `[0-9]{3}-[A-Z]{2,}!` or
        `\\w+@\\w+\\.com` needs characters they lack, and its output ran to the budget
        unfinished. Filling the mask costs 2 units of the search budget."""
        chars = self._single_characters()
        budget[0] -= 2
        ids = chars[0]
        allowed = self._allowed(m, ids)
        closers = set(self._closer_ids())
        wordy, other, kinds = [], [], set()
        for tok, text, ok in zip(ids.tolist(), chars[1], allowed.tolist()):
            if not ok or tok in closers:
                continue
            if _wordy(text):
                kind = "0" if text.isdigit() else "A" if text.isupper() else "a" if text.isalpha() else text
                if kind not in kinds:
                    kinds.add(kind)
                    wordy.append(tok)
            elif len(other) < 6:
                other.append(tok)
        return wordy, other

    def _single_characters(self) -> tuple[np.ndarray, list[str]]:
        """The tokens spelled as one printable ASCII character, a newline or a tab: ids, texts
        (in byte order)."""
        if self._chars is None:
            spelled = self._spelling()[0]
            pairs = sorted((b, t) for t, b in enumerate(spelled) if b is not None and len(b) == 1
                           and (0x20 <= b[0] < 0x7F or b in (b"\n", b"\t")))
            self._chars = (np.array([t for _, t in pairs], dtype=np.int64),
                           [b.decode() for b, _ in pairs])
        return self._chars

    def _quote_closer_ids(self) -> list[int]:
        if self._quotes is None:
            closers = self._closer_ids()
            self._quotes = [t for t in closers if self.tokenizer.decode([t]).startswith('"')]
        return self._quotes

    def _inside_string(self, m) -> bool:
        """The grammar takes a plain letter here: string content (a literal such as `false`
        would have been forced by jump-forward instead)."""
        letter = self._letter_id()
        if letter is None or not m.accept_token(letter):
            return False
        m.rollback(1)
        return True

    def _letter_id(self) -> int | None:
        if not hasattr(self, "_letter"):
            enc = self.tokenizer.encode("a", add_special_tokens=False)
            self._letter = enc[0] if len(enc) == 1 else None
        return self._letter

    def _plan_closing(self, m, max_len: int, shortest: bool = True,
                      any_text: bool = False, nodes: int = CLOSE_SEARCH_NODES) -> list[int] | None:
        """A short token sequence after which the matcher can terminate (None if none within
        max_len tokens or `nodes` expansions): iterative deepening finds the shortest when it
        is a few tokens deep (`shortest`); else a depth-first search, closers first, finds a
        longer one."""
        budget = [nodes // 2 if shortest else 0]
        for depth in range(min(max_len, CLOSE_SHORTEST_DEPTH) + 1 if shortest else 0):
            path: list[int] = []
            if self._search(m, depth, path, budget, any_text):
                return path
            if budget[0] <= 0:
                break
        path = []
        return path if self._search(m, max_len, path, [nodes // 2], any_text) else None

    def _search(self, m, depth: int, path: list[int], budget: list[float],
                any_text: bool = False) -> bool:
        """Depth-limited search; every token tried costs one unit of budget (CLOSE_REFUSED_COST
        when the matcher refuses it). `any_text`: the constraint is not JSON (a regex, a
        grammar): other characters than JSON's closers are tried too (_other_characters)."""
        if m.can_terminate():
            return True
        if depth <= 0:
            return False
        forced = m.find_jump_forward_string()
        more = not any_text and not forced  # JSON: other characters if nothing else works
        if forced:
            options = [self._encode_forced(forced)]
        elif (inside := self._inside_string(m)) and any(
                _accepts(m, t) for t in self._quote_closer_ids()):
            # only a quote ends a string; any other closer is string content, and a depth-first
            # search that takes it wanders down ever longer strings until the budget is gone
            options = [[t] for t in self._quote_closer_ids()]
            more = False
        elif inside:
            # free text no quote ends (a regex's `[a-z]+`, a string short of its minLength):
            # words last, so a search leaves the run of letters (to ` `, a digit) before it
            # lengthens it (it took only quotes here, found no closing for
            # `([a-z]+ ){1,4}[0-9]{2}[.]`, and the output ran to the budget unfinished)
            wordy, other = self._free_text_closer_ids()
            more_wordy, more_other = self._other_characters(m, budget) if any_text else ([], [])
            # (a schema's required keys before the word characters, after the punctuation a
            # key never takes: a string value's pattern may take `:` and end sooner)
            options = ([[t] for t in other + more_other] + self._required_options(m, budget)
                       + [[t] for t in wordy + more_wordy])
        else:  # a quote here opens a string: the other closers first
            quotes = self._quote_closer_ids()
            options = [[t] for t in self._closer_ids() if t not in quotes]
            options += [[t] for t in quotes]
            more_wordy, more_other = self._other_characters(m, budget) if any_text else ([], [])
            options += [[t] for t in more_other + more_wordy]
        if self._search_options(m, depth, path, budget, any_text, options, bool(forced)):
            return True
        if more and budget[0] > 0:
            # JSON's closers spell no key: where the grammar takes one of several (`reason`,
            # `status`) and forces none, the search goes on from a first letter, jump-forward's
            # text taking the rest; free text gets the characters its pattern needs
            tried = {t for toks in options for t in toks}
            more_wordy, more_other = self._other_characters(m, budget)
            options = [o for o in self._required_options(m, budget) if o[0] not in tried]
            options += [[t] for t in more_other + more_wordy if t not in tried]
            return self._search_options(m, depth, path, budget, any_text, options, False)
        return False

    def _required_options(self, m, budget: list[float]) -> list[list[int]]:
        """The first tokens of the searched JSON schema's required keys that matcher m takes
        here (a key being spelled). Each token tried costs CLOSE_REFUSED_COST of the search
        budget; more than 16 are checked by one mask fill instead (2 units)."""
        ids = self._required_now
        if ids is None:
            return []
        if len(ids) * CLOSE_REFUSED_COST <= 2:
            budget[0] -= len(ids) * CLOSE_REFUSED_COST
            return [[t] for t in ids.tolist() if _accepts(m, t)]
        budget[0] -= 2
        return [[t] for t in ids[self._allowed(m, ids).astype(bool)].tolist()]

    def _search_options(self, m, depth: int, path: list[int], budget: list[float],
                        any_text: bool, options: list[list[int]], forced: bool) -> bool:
        for toks in options:
            if budget[0] <= 0:
                return False
            if len(toks) > depth:
                budget[0] -= CLOSE_REFUSED_COST
                continue
            n = m.accept_prefix(toks)
            budget[0] -= 1 if n else CLOSE_REFUSED_COST
            if n == len(toks):
                path.extend(toks)
                if self._search(m, depth - n, path, budget, any_text):
                    m.rollback(n)
                    return True
                del path[-n:]
            if n:
                m.rollback(n)
            if forced:
                break  # forced text is the only way on
        return False
