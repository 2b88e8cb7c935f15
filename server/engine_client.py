"""The engine thread and its asyncio bridge: continuous batching behind an async API.

NOTE: threads and queues. ``LLMEngine`` is not thread-safe, so exactly one thread (the engine
thread, started by :meth:`EngineClient.start`) calls it. The event loop talks to it through one
thread-safe command queue (add a group of requests, abort requests, stop); the engine thread
answers through ``loop.call_soon_threadsafe``, once per step, handing every ``RequestOutput`` to
the asyncio queue of the :class:`RequestStream` that owns it. An add is acknowledged (or refused
with the engine's ``RequestError``) before the HTTP layer answers, so a bad prompt is a plain 400
and a stream never starts for a request the engine refused.

NOTE: continuous batching with auto-batching (MoE-Infinity §7.4, "auto-batching of requests
based on the maximal latency and maximal batch size"). Requests join and leave the running batch
between steps: the engine's FCFS scheduler admits waiting requests whenever a batch slot and the
KV-cache blocks of their first chunk are free (preempting the latest running request when a
running one finds none: it is recomputed later, its client only waits), and finished or aborted
requests leave at once. When the engine is idle and a
request arrives, the thread waits up to ``max_wait_ms`` for more requests (stopping early once
``max_batch_size`` are waiting) before the first step, so a burst shares its prefill step and its
expert fetches instead of the first request running alone.

NOTE: failures. A request whose own post-processing failed (``finish_reason="error"``, see
``LLMEngine``) ends its HTTP request with a 500 ``server_error`` (a JSON body, or an error event
then ``[DONE]`` on a stream); its sibling choices are aborted and every other request carries on.
If ``step()`` itself raises (a device or runtime fault), the engine is declared dead: every open
request gets a 503 ``engine_dead``, ``/health`` turns 503, new requests are refused, and
``on_dead`` is called on the event loop (the runner stops the server and the process exits
non-zero, so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from moe_runtime.engine.request import RequestOutput, SamplingParams
from moe_runtime.errors import MoeServeError
from moe_runtime.stats import EngineStats
from server.errors import APIError

log = logging.getLogger("moeserve.server")


@dataclass(slots=True)
class EngineRequest:
    """One engine request: an HTTP request with ``n`` choices or several prompts makes several."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestStream:
    """The outputs of one HTTP request's engine requests, in the order the engine made them.

    Iterate with ``async for``; iteration ends once every member request finished. It raises
    :class:`APIError` (503) if the engine dies meanwhile.
    """

    def __init__(self, client: EngineClient, request_ids: list[str]) -> None:
        self._client = client
        self.request_ids = request_ids
        self._open = set(request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    @property
    def finished(self) -> bool:
        return not self._open

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._open:
            item = await self._queue.get()
            if isinstance(item, RequestOutput) and item.error is not None:
                self._open.discard(item.request_id)
                self.abort()  # the response cannot be whole: stop its other choices
                item = APIError(500, item.error, "server_error")
            if isinstance(item, BaseException):
                self._open.clear()
                raise item
            if item.finished:
                self._open.discard(item.request_id)
            yield item

    def abort(self) -> None:
        """Cancel the members still running (client gone); frees their KV blocks and slots."""
        if self._open:
            self._client.abort(sorted(self._open))
            self._open.clear()


@dataclass(slots=True)
class _Add:
    requests: list[EngineRequest]
    ack: asyncio.Future[None]


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class Snapshot:
    """What the engine thread publishes after each step (read by metrics and admission)."""

    num_running: int = 0
    num_waiting: int = 0
    stats: EngineStats = field(default_factory=EngineStats)


class EngineClient:
    """Owns the engine thread; the async face of one :class:`~moe_runtime.engine.engine.LLMEngine`.

    Args:
        engine: the engine (this client's thread becomes its only caller).
        max_wait_ms: auto-batching window when the engine is idle (milliseconds).
        max_queue: most engine requests beyond a full batch (open requests minus
            ``max_batch_size``); an add that would pass it gets 429. Counting against the batch
            size rather than the running snapshot keeps admission independent of step timing.
        on_finished: called on the event loop with each finished ``RequestOutput`` (histograms);
            a public attribute, settable later.
        after_step: called on the engine thread after every step (EAMC saving); exceptions in it
            are logged, never fatal.
        on_dead: called once on the event loop with the exception after ``step()`` raised and
            every open request was failed; a public attribute (the runner sets it to stop the
            process).
    """

    def __init__(
        self,
        engine: Any,
        max_wait_ms: float = 5.0,
        max_queue: int = 256,
        on_finished: Callable[[RequestOutput], None] | None = None,
        after_step: Callable[[], None] | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.max_batch_size: int = engine.runtime.max_batch_size
        self.on_finished = on_finished
        self._after_step = after_step
        self.on_dead = on_dead
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle: asyncio.Event | None = None
        self._engine_ids: set[str] = set()  # engine thread only: ids the engine holds
        self.snapshot = Snapshot()
        self.draining = False
        self.dead: BaseException | None = None

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="moeserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_open(self) -> int:
        """Engine requests the server holds open (waiting or running)."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Engine requests not yet in the running batch (a step stale at most)."""
        return max(0, len(self._streams) - self.snapshot.num_running)

    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue a group of engine requests; returns once the engine accepted all of them.

        Raises:
            APIError: 503 while draining or after the engine died; 400 when the group alone
                is larger than a full batch plus the queue; 429 when more than
                ``max_queue`` requests would wait beyond a full batch; 400 when the engine
                refuses a request (the group is then dropped whole).
        """
        if self.draining:
            raise APIError(503, "the server is shutting down", "shutting_down")
        if not self.alive:
            raise APIError(503, "the engine is not running", "engine_dead")
        if len(requests) > self.max_batch_size + self.max_queue:
            msg = (
                f"the request needs {len(requests)} sequences (prompts x n); this server holds at "
                f"most {self.max_batch_size + self.max_queue} (--max-batch-size + --max-queue)"
            )
            raise APIError(400, msg, "invalid_value", "n")
        queued = len(self._streams) + len(requests) - self.max_batch_size
        if queued > self.max_queue:
            msg = f"too many requests waiting for a batch slot (at most {self.max_queue}); retry later"
            raise APIError(429, msg, "queue_full")
        assert self._loop is not None and self._idle is not None
        stream = RequestStream(self, [r.request_id for r in requests])
        for r in requests:
            self._streams[r.request_id] = stream
        self._idle.clear()
        ack: asyncio.Future[None] = self._loop.create_future()
        self._commands.put(_Add(requests, ack))
        if self.dead is not None:  # died between the check and the put: answer it ourselves
            self._refuse_pending()
        try:
            await ack
        except BaseException:
            self._forget(stream.request_ids)
            if not ack.done() or ack.cancelled():  # caller cancelled: undo the add
                self.abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests (unknown or finished ids are ignored)."""
        self._forget(request_ids)
        self._commands.put(_Abort(list(request_ids)))

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)
        if not self._streams and self._idle is not None:
            self._idle.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Runs on the loop: route one step's outputs to their streams."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.put(out)
            if out.finished:
                self._forget([out.request_id])
                if self.on_finished is not None and out.finish_reason not in ("abort", "error"):
                    try:
                        self.on_finished(out)
                    except Exception:
                        log.exception("on_finished hook failed")

    def _fail_all(self, exc: BaseException, cause: BaseException) -> None:
        """Runs on the loop after the engine died: every open request gets the error, then
        ``on_dead`` hears of it."""
        for stream in set(self._streams.values()):
            stream.put(exc)
        self._forget(list(self._streams))
        if self.on_dead is not None:
            try:
                self.on_dead(cause)
            except Exception:
                log.exception("on_dead hook failed")

    async def drain(self, timeout_s: float, stop: bool = True) -> None:
        """Refuse new requests, wait up to ``timeout_s`` for open ones, answer the rest, stop.

        At the deadline every request still open is aborted in the engine and its stream gets
        :class:`APIError` 503 ``shutting_down`` (the routes turn it into a JSON error or an SSE
        error event followed by ``[DONE]``).

        Args:
            timeout_s: seconds open requests may take to finish.
            stop: also stop the engine thread (False: the server's shutdown drains first and the
                app's lifespan exit stops the thread later).
        """
        self.draining = True
        if self._idle is not None and self._streams:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except TimeoutError:
                left = list(self._streams)
                log.warning("drain timeout (%.1f s): %d open request(s) get 503", timeout_s, len(left))
                error = APIError(503, f"the server shut down after a {timeout_s:g} s drain", "shutting_down")
                for stream in set(self._streams.values()):
                    stream.put(error)
                self.abort(left)
        if not stop:
            return
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 60.0)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not engine.has_unfinished():
                    if not self._handle(self._commands.get()):
                        return
                    if engine.has_unfinished() and not self._gather():
                        return
                elif not self._drain_commands():
                    return
                if not engine.has_unfinished():
                    self._publish()
                    continue
                outputs = engine.step()
                self._publish()
                for out in outputs:
                    if out.finished:
                        self._engine_ids.discard(out.request_id)
                if outputs:
                    self._call(self._deliver, outputs)
                if self._after_step is not None:
                    try:
                        self._after_step()
                    except Exception:
                        log.exception("after_step hook failed")
        except Exception as exc:
            log.exception("the engine thread died")
            self.dead = exc
            err = APIError(503, "the engine failed; the server is restarting", "engine_dead")
            self._call(self._fail_all, err, exc)
            self._refuse_pending()

    def _gather(self) -> bool:
        """Auto-batching: after the first request reaches an idle engine, wait up to max_wait
        for more, until ``max_batch_size`` are waiting. False when told to stop."""
        deadline = time.monotonic() + self.max_wait_s
        while self.engine.num_waiting < self.max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                cmd = self._commands.get(timeout=remaining)
            except queue.Empty:
                break
            if not self._handle(cmd):
                return False
        return True

    def _drain_commands(self) -> bool:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if not self._handle(cmd):
                return False

    def _handle(self, cmd: _Add | _Abort | None) -> bool:
        """Apply one command on the engine thread; False means stop."""
        if cmd is None:
            self._abort_in_engine(list(self._engine_ids))
            self._publish()
            return False
        if isinstance(cmd, _Abort):
            self._abort_in_engine(cmd.request_ids)
            return True
        added: list[str] = []
        try:
            for r in cmd.requests:
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params)
                added.append(r.request_id)
                self._engine_ids.add(r.request_id)
        except Exception as exc:
            self._abort_in_engine(added)
            param = getattr(exc, "param", None) or "body"
            err = APIError(400, str(exc), "invalid_value", param) if isinstance(exc, MoeServeError) else exc
            self._call(_settle, cmd.ack, err)
            return True
        self._call(_settle, cmd.ack, None)
        return True

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid in self._engine_ids:
                self.engine.abort_request(rid)
                self._engine_ids.discard(rid)

    def _refuse_pending(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._call(_settle, cmd.ack, APIError(503, "the engine is not running", "engine_dead"))

    def _publish(self) -> None:
        e = self.engine
        stats = copy.copy(e.stats)
        stats.requests_finished = dict(e.stats.requests_finished)
        self.snapshot = Snapshot(e.num_running, e.num_waiting, stats)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(fn, *args)


def _settle(fut: asyncio.Future[None], err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
