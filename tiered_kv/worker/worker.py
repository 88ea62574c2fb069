"""Worker-side contract and router: handlers move bytes, the worker routes jobs to them.

Runs in each worker (model-runner) process, one per GPU. A handler owns one
(src medium, dst medium) direction and does that direction's I/O (CUDA copies, disk
reads/writes) asynchronously; the only thing that flows back to the scheduler is a
job's completion: its id, whether it succeeded, and how long its transfer took.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from tiered_kv.abstract import Closing, LoadStoreSpec
from tiered_kv.mediums import TierWrites

logger = logging.getLogger(__name__)

#: ``(src_spec, dst_spec)`` of one transfer.
TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]


@dataclass(frozen=True, order=True, slots=True)
class TransferResult:
    """A finished job: its id and whether every byte of it was transferred correctly.

    ``seconds``: how long the transfer took, measured by the handler from when the job
    started moving data to when its last byte landed (CUDA events on a stream), not
    until some caller polled ``get_finished``; None for a failed job.
    ``transfer_size``: the bytes the job moved (None for a failed job), and
    ``transfer_type``: its ``(src medium, dst medium)``, as vLLM 0.33's results carry
    them; set by the handler, or by ``OffloadingWorker`` from the job's spec.
    ``failed_gpu_blocks``: of a failed load, the GPU blocks of the parts that failed,
    where the handler knows them (the others landed whole); None: any of the job's.
    Results compare by id and success only.
    """

    job_id: int
    success: bool
    seconds: float | None = field(default=None, compare=False)
    transfer_size: int | None = field(default=None, compare=False)
    transfer_type: tuple[str, str] | None = field(default=None, compare=False)
    failed_gpu_blocks: tuple[int, ...] | None = field(default=None, compare=False)


class OffloadingHandler(Closing, ABC):
    """Moves KV data in one direction, asynchronously. Worker process.

    Contract: ``transfer_async`` never waits for the data to move; each submitted job
    is reported exactly once by ``get_finished`` (after it completes or fails);
    ``wait`` blocks until the given jobs complete (they are still reported by the next
    ``get_finished``).
    """

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start transferring ``spec``'s blocks; return True if the job was accepted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Return jobs finished since the last call. Never blocks."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` has finished (unknown ids are ignored)."""

    def shutdown(self) -> None:
        """Release resources; in-flight jobs are finished or abandoned, never left hanging."""
        return


class HandlerRegistrationError(ValueError):
    """A (src, dst) medium pair was registered twice."""


class UnregisteredTransferError(LookupError):
    """A transfer named a (src, dst) medium pair with no handler."""


class OffloadingWorker(Closing):
    """Routes each transfer to the handler registered for ``(src.medium(), dst.medium())``.

    As the seed specifies, a job that ``transfer_async`` did not accept (the handler
    refused it, or raised, which is logged and does not crash the worker) was never
    submitted: ``get_finished`` never reports it, and the caller settles it at once.
    """

    def __init__(self) -> None:
        self.handlers: set[OffloadingHandler] = set()
        self.transfer_type_to_handler: dict[tuple[str, str], OffloadingHandler] = {}
        self._job_handler: dict[int, OffloadingHandler] = {}
        self._job_type: dict[int, tuple[str, str]] = {}

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        """Route transfers from ``src_cls``'s medium to ``dst_cls``'s medium to ``handler``.

        Raises ``HandlerRegistrationError`` if that pair already has a handler.
        """
        pair = (src_cls.medium(), dst_cls.medium())
        existing = self.transfer_type_to_handler.get(pair)
        if existing is not None:
            raise HandlerRegistrationError(
                f"a handler for transfers {pair[0]} -> {pair[1]} is already registered "
                f"({type(existing).__name__}); register each (src, dst) medium pair once"
            )
        self.transfer_type_to_handler[pair] = handler
        self.handlers.add(handler)

    def handler_for(self, spec: TransferSpec) -> OffloadingHandler:
        """The handler registered for ``spec``'s medium pair; raises
        ``UnregisteredTransferError`` naming the pair and the registered ones."""
        src, dst = spec
        pair = (src.medium(), dst.medium())
        handler = self.transfer_type_to_handler.get(pair)
        if handler is None:
            known = ", ".join(f"{s} -> {d}" for s, d in sorted(self.transfer_type_to_handler)) or "none"
            raise UnregisteredTransferError(
                f"no handler registered for transfers {pair[0]} -> {pair[1]} (registered: {known})"
            )
        return handler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit a job to its handler. Returns whether it was accepted; a job that was
        not accepted (handler refused or raised) was never submitted and is never
        reported by ``get_finished``.

        Raises ``UnregisteredTransferError`` for a medium pair with no handler: that is
        a wiring bug, not a runtime fault.
        """
        handler = self.handler_for(spec)
        try:
            accepted = handler.transfer_async(job_id, spec)
        except Exception:
            logger.exception(
                "handler %s raised while submitting job %d; it was not submitted", type(handler).__name__, job_id
            )
            accepted = False
        if accepted:
            self._job_handler[job_id] = handler
            self._job_type[job_id] = (spec[0].medium(), spec[1].medium())
        return bool(accepted)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, from every handler, each with its transfer
        type. Never blocks."""
        finished: list[TransferResult] = []
        for handler in self.handlers:
            try:
                results = handler.get_finished()
            except Exception:
                logger.exception("handler %s raised in get_finished; failing its jobs", type(handler).__name__)
                results = [TransferResult(j, False) for j, h in self._job_handler.items() if h is handler]
            finished.extend(results)
        out = []
        for result in finished:
            self._job_handler.pop(result.job_id, None)
            transfer_type = self._job_type.pop(result.job_id, None)
            if result.transfer_type is None and transfer_type is not None:
                result = replace(result, transfer_type=transfer_type)
            out.append(result)
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs have finished, on whichever handlers run them."""
        by_handler: dict[OffloadingHandler, set[int]] = {}
        for job_id in job_ids:
            handler = self._job_handler.get(job_id)
            if handler is not None:
                by_handler.setdefault(handler, set()).add(job_id)
        for handler, ids in by_handler.items():
            handler.wait(ids)

    def shutdown(self) -> None:
        for handler in self.handlers:
            try:
                handler.shutdown()
            except Exception:
                logger.exception("handler %s raised in shutdown", type(handler).__name__)


# ---- what a tier below CPU gives the composite's handlers in a worker


class Stager(Protocol):
    """Worker side of a lower tier's writes: copies CPU slots out (so the slots may be
    reused at once) and writes them into the tier in the background, where each
    block's durability is recorded for the scheduler's ``LowerTier`` to learn."""

    def stage(self, writes: TierWrites) -> Future[None]:
        """Start copying ``writes``' CPU slots out; the future is done once those slots
        may be overwritten."""

    def abandon(self, writes: TierWrites) -> None:
        """``writes`` will never be staged (their job failed first): record their failure
        where the tier learns each write's outcome, as for a write that failed."""

    def drain(self) -> None:
        """Block until every staged write has landed (or failed)."""

    def shutdown(self) -> None:
        """Drain, then stop the stager's threads."""


class LowerTierWorker(NamedTuple):
    """What a lower tier gives the composite's handlers in a worker process: its stager,
    and its handlers for reads into the GPU and into CPU slots (None where a tier has
    no such path)."""

    stager: Stager | None
    to_gpu: OffloadingHandler | None
    to_cpu: OffloadingHandler | None
