"""One engine worker thread: a FIFO queue of jobs, batched continuously across sampling settings.

The oldest job always runs next (no starvation); queued jobs whose keys merge with its own (the
engine's `batch_key` and `merged`: greedy, sampled at a temperature, or with top-k / top-p too,
each kind's code serving the kinds before it, so a batch takes any mix and runs the widest kind
among them; each row samples with its own request's values) start with it, up to `max_batch`
rows (a power of two of them: the engine's states come in those sizes; all max_batch of them
with `fixed_rows`, seeded jobs included). While the batch decodes, a row that ends frees its
slot, and the jobs at the head of the queue join it while the batch holds them as it is (a job
of a wider kind would need other graphs) and they fit (a batch under max_batch rows takes them
only if all of them fit, else it drains and the next opens larger); a job the batch does not
hold at the head waits for the batch to drain, and so does everything queued behind it. Seeded
sampled jobs never join a running batch (their draws would depend on it). A job reports through
`sink(event)`, called on the worker thread: ("delta", index, text[, ids]) (ids: a stream's with
return_token_ids; its finish's Choice holds the ids they did not carry), ("finish", index, Choice),
("done", completion_tokens), ("error", status, message[, param, code]) (`ApiError`'s arguments);
and ("accepted",) once, from `submit` (the job is queued: an error from then on is the engine's,
not the request's). An engine exception fails only the jobs of that batch still running: those
that have sent nothing yet are rerun one by one, so only the culprit gets the error; a job
whose own text fails (detokenizing, stop strings) fails alone, its rows freed as the batch decodes
on. Engine time (/metrics' `engine_busy_s`, under `tokens_per_s`) runs from a batch's opening,
its first prompt pass included, as joiners' passes are. A row whose client leaves frees its
slot after the step under way, not at the next look (`_decode`). `stop`
answers the queued jobs with a 503 at once, and the running batch's jobs too if it has not ended
within the timeout: code "unavailable", as a submit it refuses; /metrics counts each such 503
as "stopped", and so does `cut_off`, a forced quit's 503 that the app sends itself. Each job's end
is counted once (`Job.end`), by whichever of them comes first: a job that completed before a
forced quit cut its reply off stays "completed". "engine_gone" is always 0 here: the 503s a
`--frontends` process answers itself once the engine process is gone, which that frontend
counts (`frontends.RemoteScheduler`).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from draftsmith.serve.engine import CHECK_EVERY, ServeEngine, batch_rows, trim
from draftsmith.serve.jobs import Job
from draftsmith.serve.protocol import STOPPING, ApiError, Choice
from draftsmith.serve.text import ChoiceText
from draftsmith.switches import env_count

BATCH_WAIT_S = 0.005  # how long the worker waits for same-setting requests to fill a batch
# A continuous batch admits queued jobs once this many of its rows are free (or all of them, in
# a smaller batch), or once the head of the queue has waited JOIN_WAIT_MS: each join is a prompt
# pass, launch-bound on a GPU whatever its rows, so joins in larger groups could pay. 1: join
# as soon as a row is free (the default; untimed otherwise: serve_h200.md, next lease).
JOIN_AT = env_count("DRAFTSMITH_SERVE_JOIN_AT", "1")
JOIN_WAIT_MS = env_count("DRAFTSMITH_SERVE_JOIN_WAIT_MS", "20")


def unavailable() -> ApiError:
    """The 503 of a server that is stopping, one body wherever it is sent (OpenAI's format:
    message, type, param, code): a refused submit and every job `stop` cuts off alike."""
    return ApiError(503, STOPPING, code="unavailable")


def _cut_off(job: Job) -> None:
    e = unavailable()
    job.emit(("error", e.status, e.message, e.param, e.code))


class Row:
    """One choice of one job inside a batch."""

    def __init__(self, job: Job, index: int, prompt: list[int], eos: list[int],
                 decode: Callable[[list[int]], str]) -> None:
        self.job, self.index, self.prompt, self.eos = job, index, prompt, eos
        self.limit = job.req.max_tokens
        self.text = ChoiceText(decode, job.req.stop, job.req.stream)
        self.tokens: list[int] = []
        self.used = 0  # completion_tokens: the tokens, and an eos that ended them (as vLLM)
        self.finished = False
        # a stream's return_token_ids: (tokens, characters) each time the text grew, and how
        # many ids the deltas carried (those of the text they sent; the rest come at the finish)
        self.marks: deque[tuple[int, int]] = deque()
        self.ids_sent = 0

    def feed(self, raw: list[int], final: bool) -> None:
        if self.finished:
            return
        if self.job.cancelled:
            self.finished = True
            return
        toks, eos_hit = trim(raw[: self.limit], self.eos)  # an eos past the limit is not ours
        self.tokens = toks[: self.limit]
        done = final or eos_hit or len(toks) >= self.limit
        grown = len(self.text.text)
        delta = self.text.feed(self.tokens, done)
        if self.text.stopped:  # tokens decoded past the stop string are not the answer's
            self.tokens = self.tokens[: self.text.tokens_used(self.tokens)]
        self.used = len(self.tokens) + (eos_hit and not self.text.stopped)
        req = self.job.req
        ids = req.stream and req.token_ids
        # a text that ends inside a token's character is no whole-token mark: its ids wait
        if ids and not self.text.stopped and not self.text.partial and len(self.text.text) > grown:
            self.marks.append((len(self.tokens), len(self.text.text)))
        if delta and req.stream:  # with return_token_ids, the ids of the text it sends
            self.job.emit(("delta", self.index, delta, *([self._ids_of_sent()] if ids else [])))
        if done or self.text.stopped:
            self.finished = True
            stop = eos_hit or self.text.stopped or len(self.tokens) < self.limit
            text = "" if req.stream else self.text.text
            ended = raw[len(self.tokens): self.used]  # the eos that ended them, as vLLM's
            # a stream's finish carries the ids its deltas did not (as its text: none left)
            left = (self.tokens + ended)[self.ids_sent:]
            self.job.emit(("finish", self.index, Choice(text, "stop" if stop else "length",
                                                        self.used, left)))

    def _ids_of_sent(self) -> list[int]:
        """The ids whose text the deltas have now sent in full, not sent before: the text of
        the first `tokens` ids is the first `characters` of the answer's (incremental
        detokenization grows it only by whole tokens), so held-back text keeps its ids back
        until a delta releases it, and ids past a stop string wait for the finish, which
        sends only the answer's."""
        upto = self.ids_sent
        while self.marks and self.marks[0][1] <= self.text.sent:
            upto = max(upto, self.marks.popleft()[0])
        upto = min(upto, len(self.tokens))
        out, self.ids_sent = self.tokens[self.ids_sent: upto], max(self.ids_sent, upto)
        return out


class Metrics:
    def __init__(self, speculative: bool) -> None:
        self.speculative = speculative
        self.started = time.time()
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("requests", "completed", "rejected", "failed", "cancelled", "stopped", "engine_gone",
             "batches", "batch_rows", "joined_rows", "prompt_tokens", "completion_tokens"), 0)
        self.engine_s = 0.0
        self.queue_s = 0.0
        self.accept_hist: list[int] = []

    def add(self, **kv: int) -> None:
        with self.lock:
            for k, v in kv.items():
                self.counts[k] += v

    def admitted(self, rows: int, waited: float, opened: bool) -> None:
        """Rows that opened a batch (or joined one), and their summed queue wait."""
        with self.lock:
            self.queue_s += waited
            if opened:
                self.counts["batches"] += 1
                self.counts["batch_rows"] += rows
            else:
                self.counts["joined_rows"] += rows

    def ran(self, seconds: float, hist: list[int] | None) -> None:
        """Engine time and accepted-length counts since the last look, recorded every look so
        a batch that never drains still shows in /metrics."""
        with self.lock:
            self.engine_s += seconds
            if hist:
                if len(self.accept_hist) < len(hist):
                    self.accept_hist += [0] * (len(hist) - len(self.accept_hist))
                for k, c in enumerate(hist):
                    self.accept_hist[k] += c

    def snapshot(self, queued: int) -> dict[str, Any]:
        with self.lock:
            c = dict(self.counts)
            out: dict[str, Any] = {**c, "queued": queued, "uptime_s": time.time() - self.started,
                                   "engine_busy_s": self.engine_s}
            out["tokens_generated"] = c["completion_tokens"]
            out["tokens_per_s"] = c["completion_tokens"] / self.engine_s if self.engine_s else 0.0
            out["mean_batch_rows"] = c["batch_rows"] / c["batches"] if c["batches"] else 0.0
            rows = c["batch_rows"] + c["joined_rows"]
            out["mean_queue_wait_s"] = self.queue_s / rows if rows else 0.0
            out["speculative"] = self.speculative
            if self.speculative:
                n = sum(self.accept_hist)
                mean = sum(k * v for k, v in enumerate(self.accept_hist)) / n if n else 0.0
                out["mean_accept_length"] = mean
                out["accept_hist"] = list(self.accept_hist)
            return out


class Scheduler:
    def __init__(self, engine: ServeEngine, max_queue: int = 256,
                 batch_wait: float = BATCH_WAIT_S, continuous: bool = True,
                 join_at: int = JOIN_AT, join_wait: float = JOIN_WAIT_MS / 1000) -> None:
        self.engine, self.max_queue, self.batch_wait = engine, max_queue, batch_wait
        self.join_at, self.join_wait = max(1, join_at), join_wait
        self.continuous = continuous  # False: a batch runs until its last row ends
        self.max_batch, self.fixed_rows = engine.cfg.max_batch, engine.cfg.fixed_rows
        self.metrics = Metrics(engine.speculative)
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._abort = False  # stop() waited long enough: the running batch's jobs end now
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="draftsmith-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Queued jobs get a 503 now; a running batch has `timeout` seconds to end, then its
        jobs get a 503 at its next look, so every waiter is answered and the engine is free."""
        with self._cv:
            self._stopping = True
            left = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        self._cut_off(left)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._abort = True
                self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def queued(self) -> int:
        """Queued jobs whose clients still wait (those that left are dropped at the next look)."""
        with self._cv:
            return sum(not j.cancelled for j in self._queue)

    status_waits = False  # `status` reads this process's counters: the event loop calls it

    def status(self) -> dict[str, Any]:
        """What /health and /metrics show; `stopping` once `stop` began (submits get a 503)."""
        n = self.queued()
        return {"alive": self.alive, "stopping": self._stopping, "queued": n,
                "metrics": self.metrics.snapshot(n)}

    def count(self, **kv: int) -> None:
        self.metrics.add(**kv)

    @staticmethod
    def cancel(job: Job) -> None:
        """The client is gone: the job's rows stop at the next look."""
        job.cancelled = True

    def cut_off(self, job: Job) -> None:
        """The server answers `job` with a 503 itself (a forced quit): its rows stop at the next
        look and it counts as stopped, not cancelled (unless the worker counted its end first)."""
        job.cancelled = True
        self._ended(job, "stopped")

    def _ended(self, job: Job, how: str) -> None:
        if job.end():
            self.metrics.add(**{how: 1})

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping or not self.alive:
                self.metrics.add(stopped=1)
                raise unavailable()
            if len(self._queue) >= self.max_queue:
                self._drop_cancelled()
            if len(self._queue) >= self.max_queue:
                raise ApiError(429, f"the queue is full ({self.max_queue} requests); retry later",
                               code="queue_full", kind="rate_limit_error")
            job.batch_key = self.engine.batch_key(job.req.params)
            self._queue.append(job)
            # before the worker can take it: a stream's 200 goes out now, not with its first token
            job.emit(("accepted",))
            self._cv.notify_all()
        self.metrics.add(requests=1)

    def _drop_cancelled(self) -> None:
        """Forget the queued jobs whose clients left (they hold no rows; nobody waits)."""
        for j in self._queue:
            if j.cancelled:
                self._ended(j, "cancelled")
        self._queue = deque(j for j in self._queue if not j.cancelled)

    # ---- worker --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._run(batch)
            except Exception as e:  # never let the worker die
                self._fail(batch, e)
            finally:
                if batch[0].req.seeded:  # unseeded draws after it are no function of its seed
                    torch.seed()

    def _take(self) -> list[Job] | None:
        with self._cv:
            while True:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return None
                head = self._queue[0]
                self._cv.wait_for(lambda h=head: self._stopping or self._rows(h) >= self.max_batch,
                                  self.batch_wait)
                batch = self._select()
                if batch:
                    return batch

    def _rows(self, head: Job) -> int:
        return sum(j.req.rows for j in self._queue
                   if j is head or self._merged(head.key, j) is not None)

    def _merged(self, key: tuple, job: Job) -> tuple | None:
        """The key of a batch of `key` that `job` joins, or None when it cannot."""
        if key[0] != "batch" or job.key[0] != "batch":
            return None
        merged = self.engine.merged(key[1], job.key[1])
        return None if merged is None else ("batch", merged)

    def _key_of(self, batch: list[Job]) -> tuple:
        key = batch[0].key
        for j in batch[1:]:
            key = self._merged(key, j)
        return key

    def _select(self) -> list[Job]:
        self._drop_cancelled()
        live = list(self._queue)
        if not live:
            return []
        batch, rows, key = [live[0]], live[0].req.rows, live[0].key
        for j in live[1:]:
            merged = self._merged(key, j)
            if merged is not None and rows + j.req.rows <= self.max_batch:
                batch.append(j)
                rows += j.req.rows
                key = merged
        self._queue = deque(j for j in live if j not in batch)
        return batch

    def _rows_of(self, job: Job) -> list[Row]:
        eng, req = self.engine, job.req
        return [Row(job, p * req.n + k, prompt, eng.eos, eng.decode)
                for p, prompt in enumerate(req.prompts) for k in range(req.n)]

    def _run(self, batch: list[Job]) -> None:
        """Decode `batch` as one continuous batch; jobs that join are appended to it."""
        req = batch[0].req
        seeded = req.seeded
        need = sum(j.req.rows for j in batch)
        if seeded and not self.fixed_rows:
            size = need  # its draws as alone: no spare rows to draw for
        else:
            size = batch_rows(need, self.max_batch, self.fixed_rows)
        key = self._key_of(batch)
        t0 = time.perf_counter()  # engine time from here: the opening prompt pass is its work
        live = self.engine.open(size, self.engine.template(key[1]) if key[0] == "batch"
                                else req.params)
        if seeded:  # after open, whose capture or prompt pass needs no draw of this seed
            torch.manual_seed(req.seed)
        slots: list[Row | None] = [None] * size
        self.metrics.admitted(need, self._admit(live, slots, batch), opened=True)
        seen = live.hist
        while True:
            self._collect(live, slots)  # first right after a prefill: its token may end a row
            hist = live.hist
            now = time.perf_counter()
            self.metrics.ran(now - t0, hist and [a - b for a, b in zip(hist, seen, strict=True)])
            t0, seen = now, hist
            if self._abort:
                self._shut(slots)
                return
            free = slots.count(None)
            if free and self.continuous and not seeded:
                joined = self._join_into(live, slots, batch, key, size < self.max_batch)
                self._collect(live, slots, joined)  # their first tokens out now, not a step later
            if not any(slots):
                return
            self._decode(live, slots, self._steps(slots, live.tokens_per_step))

    def _decode(self, live: Any, slots: list[Row | None], n: int) -> None:
        """n steps, cut short once a row's client leaves (or a stop gives up waiting): its slot
        frees at the next look, not up to CHECK_EVERY steps on. A host-side check, no sync."""
        for _ in range(n):
            live.step(1)
            if self._abort or any(r is not None and r.job.cancelled for r in slots):
                return

    def _join_into(self, live: Any, slots: list[Row | None], batch: list[Job], key: tuple,
                   small: bool) -> list[int]:
        """Admit the queued jobs that may join, returning the slots they took; a failure to admit
        them fails or reruns them alone and leaves the running rows decoding."""
        more = self._join(key, slots.count(None), small, len(slots))
        if not more:
            return []
        try:
            waited = self._admit(live, slots, more)
        except Exception as e:  # the joiners' fault, not the running rows'
            mine = [i for i, r in enumerate(slots) if r is not None and r.job in more]
            for i in mine:
                slots[i] = None
            live.drop(mine)
            self._fail(more, e)
            return []
        batch.extend(more)
        self.metrics.admitted(sum(j.req.rows for j in more), waited, opened=False)
        return [i for i, r in enumerate(slots) if r is not None and r.job in more]

    def _admit(self, live: Any, slots: list[Row | None], jobs: list[Job]) -> float:
        """Put the jobs' rows into free slots and prefill them together; returns their summed
        queue wait (row-seconds)."""
        now, at, prompts, params, waited = time.perf_counter(), [], [], [], 0.0
        for job in jobs:
            job.rows = self._rows_of(job)
            waited += (now - job.queued_at) * len(job.rows)
            for row in job.rows:
                i = slots.index(None)
                slots[i] = row
                at.append(i)
                prompts.append(row.prompt)
                params.append(job.req.params)
        live.add(at, prompts, params)
        return waited

    @staticmethod
    def _steps(slots: list[Row | None], most: int = 1) -> int:
        """Steps before the next look: 1 while a row streams or watches for a stop string (its
        answer, and its slot, end at the step that completes one), else up to CHECK_EVERY but no
        more than it takes the nearest row to reach its limit if every step emits `most` tokens
        (a speculative cycle: steps + 1), so no row runs far past its max_tokens."""
        busy = [r for r in slots if r is not None]
        if any(r.job.req.stream or r.job.req.stop for r in busy):
            return 1
        left = min(r.limit - len(r.tokens) for r in busy)
        return max(1, min(CHECK_EVERY, -(-left // most)))

    def _collect(self, live: Any, slots: list[Row | None], only: list[int] | None = None) -> None:
        """Feed every busy row (or those in `only`) its tokens; free the slots of rows that
        finished (ended, hit their own limit or stop string, or were cancelled) and finish their
        jobs."""
        busy = [i for i, r in enumerate(slots) if r is not None and (only is None or i in only)]
        if not busy:
            return
        tokens, ended = live.read(busy)
        gone = []
        for i, toks, end in zip(busy, tokens, ended, strict=True):
            row = slots[i]
            if row is None:  # a sibling row's text failed: its job is answered
                continue
            try:
                row.feed(toks, end)
            except Exception as e:  # its own text (detokenizing, stop strings): its fault alone
                gone += self._fail_rows(slots, row.job, e)
                continue
            if row.finished:
                slots[i] = None
                gone.append(i)
                if all(r.finished for r in row.job.rows):
                    self._finish(row.job)
        live.drop(gone)

    def _fail_rows(self, slots: list[Row | None], job: Job, e: Exception) -> list[int]:
        """Fail `job` alone (a 500), its slots freed now: the rows beside it decode on, streams
        that have sent tokens included. Returns the freed slots."""
        mine = [i for i, r in enumerate(slots) if r is not None and r.job is job]
        for i in mine:
            slots[i].finished = True
            slots[i] = None
        self._fail([job], e)
        job.done = True
        return mine

    def _join(self, key: tuple, free: int, small: bool, size: int) -> list[Job]:
        """The jobs at the head of the queue that a batch of this key holds as it is (their keys
        merge into it without widening it) and that fit in `free` rows. A
        `small` batch (under max_batch rows) takes none when they do not all fit: it drains,
        and the next batch opens with more rows (joining one at a time would keep a batch of one
        row going for the whole queue). None either while fewer than `join_at` of the `size`
        rows are free and the head has waited less than `join_wait`."""
        take, rows = [], 0
        with self._cv:
            if small and self._head_rows(key) > free:
                return []
            if free < min(self.join_at, size) and self._queue and (
                    time.perf_counter() - self._queue[0].queued_at < self.join_wait):
                return []
            while self._queue:
                job = self._queue[0]
                if job.cancelled:
                    self._ended(self._queue.popleft(), "cancelled")
                    continue
                if self._merged(key, job) != key or rows + job.req.rows > free:
                    break
                take.append(self._queue.popleft())
                rows += job.req.rows
        return take

    def _head_rows(self, key: tuple) -> int:
        """Rows of the live jobs at the head of the queue that a batch of this key holds as it
        is, up to the first it does not."""
        rows = 0
        for job in self._queue:
            if job.cancelled:
                continue
            if self._merged(key, job) != key:
                break
            rows += job.req.rows
        return rows

    def _shut(self, slots: list[Row | None]) -> None:
        jobs = list(dict.fromkeys(r.job for r in slots if r is not None))
        for job in jobs:
            job.done = True
        self._cut_off(jobs)

    def _cut_off(self, jobs: list[Job]) -> None:
        """503 the jobs a stop ends, counted: those whose clients left as cancelled."""
        for job in jobs:
            self._ended(job, "cancelled" if job.cancelled else "stopped")
            if not job.cancelled:
                _cut_off(job)

    def _finish(self, job: Job) -> None:
        used = sum(r.used for r in job.rows)
        if job.cancelled:  # its client is gone: no answer went out whole
            self._ended(job, "cancelled")
        elif job.end():
            self.metrics.add(completed=1, completion_tokens=used,
                             prompt_tokens=sum(len(p) for p in job.req.prompts))
        job.done = True
        job.emit(("done", used))

    def _fail(self, batch: list[Job], e: Exception) -> None:
        print(f"draftsmith serve: engine error on a batch of {len(batch)} request(s):",
              file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
        batch = [j for j in batch if not j.done]
        retry = [j for j in batch if len(batch) > 1 and not j.sent and not j.cancelled]
        for job in batch:
            if job not in retry:
                self._ended(job, "cancelled" if job.cancelled else "failed")
                job.emit(("error", 500, f"engine error: {type(e).__name__}: {e}"))
        with self._cv:
            closed = self._stopping  # the queue is cleared for good: a rerun would never come
            for job in [] if closed else reversed(retry):
                job.solo = True
                job.queued_at = time.perf_counter()
                self._queue.appendleft(job)
            self._cv.notify_all()
        if closed:
            self._cut_off(retry)
