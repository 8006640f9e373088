"""Probe results in: ``POST /v1/measurements``."""

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.orm import Session

from ringwatch.api.deps import AgentDep, SessionDep, SettingsDep
from ringwatch.api.limits import BodyPace, IngestSlots, drain_body, read_body
from ringwatch.api.schemas import ErrorOut, IngestOut, MeasurementBatch
from ringwatch.services.errors import Busy, TooLarge
from ringwatch.services.monitor.ingest import (
    IngestLimits,
    IngestPolicy,
    IngestRequest,
    IngestResult,
    Sender,
    ingest_batch,
)
from ringwatch.services.settings import Settings
from ringwatch.services.store.tokens import Principal

router = APIRouter(prefix="/v1", tags=["measurements"])


def _parse(raw: bytes) -> MeasurementBatch:
    try:
        # From the bytes straight to the model: no intermediate tree of Python objects.
        return MeasurementBatch.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]) from None


async def batch_in_slot(request: Request, who: AgentDep) -> AsyncIterator[MeasurementBatch]:
    """The request's batch, read (at a bounded pace) and parsed only once it holds one of
    its token's ingest slots, kept until the batch is stored. The role is checked first: a
    reader waits for no slot. Refused for want of a slot, the body is drained first, so a
    client that writes it whole before reading sees the 503."""
    slots: IngestSlots = request.app.state.ingest_slots
    pace: BodyPace = request.app.state.body_pace
    try:
        await slots.acquire(who.token_id)
    except Busy:
        # A client that asked to be told before it sends (Expect: 100-continue) sent nothing.
        if request.headers.get("expect", "").lower() != "100-continue":
            await drain_body(request.receive, pace)
        raise
    try:
        raw = await read_body(request.receive, pace)
        yield await run_in_threadpool(_parse, raw)
    finally:
        slots.release(who.token_id)


BatchDep = Annotated[MeasurementBatch, Depends(batch_in_slot, scope="function")]
# The body is read by batch_in_slot, not by FastAPI; the document still says what it takes.
BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/MeasurementBatch"}}}}}


@router.post("/measurements", response_model=IngestOut, openapi_extra=BODY,
             responses={408: {"model": ErrorOut, "description": "the body came too slowly"}})
def post_measurements(batch: BatchDep, response: Response, session: SessionDep,
                      settings: SettingsDep, who: AgentDep) -> dict:
    """Store a batch of probe results once (a retried ``batch_id`` with the same content is a
    no-op, ``created: false``; the same id with other content, or sent by another token, is
    a 409) and fold its judgement into link health and fault incidents. The answer comes
    once the batch is committed.

    At most ``max_concurrent_ingests`` batches are read and stored at once, half of them
    (rounded up) for one token; one that waits longer than ``ingest_wait_s`` for its turn
    is a 503 with Retry-After (the shipper keeps it spooled and sends it then). A body that
    comes slower than ``ingest_body_timeout_s`` / ``ingest_body_min_bytes_per_s`` allow is
    a 408 with Retry-After; more than ``max_batch_findings`` findings, a 413."""
    if len(batch.measurements) > settings.max_batch_measurements:
        raise TooLarge(f"{len(batch.measurements)} measurements in one batch; the limit is "
                       f"{settings.max_batch_measurements} (RINGWATCH_MAX_BATCH_MEASUREMENTS)")
    if len(batch.findings) > settings.max_batch_findings:
        raise TooLarge(f"{len(batch.findings)} findings in one batch; the limit is "
                       f"{settings.max_batch_findings} (RINGWATCH_MAX_BATCH_FINDINGS)")
    result = _ingest(batch, session, settings, who)
    # Where the time went (store: nodes, groups, COPY; judge: health and incidents).
    response.headers["Server-Timing"] = ", ".join(
        f"{k};dur={v * 1000:.1f}" for k, v in result.timings.items())
    return {**result.to_dict(), "dropped": batch.dropped}


def _ingest(batch: MeasurementBatch, session: Session, settings: Settings,
            who: Principal) -> IngestResult:
    return ingest_batch(session, IngestRequest(
        batch_id=batch.batch_id,
        backend=batch.backend,
        measurements=[m.model_dump(exclude={"stats"}) for m in batch.measurements],
        ranks=[r.model_dump() for r in batch.ranks],
        findings=[f.model_dump(exclude_none=True) for f in batch.findings],
        duty_cycle=batch.duty_cycle,
        skipped=batch.skipped,
        shipper=batch.shipper.model_dump() if batch.shipper else None,
        counters=[c.model_dump() for c in batch.counters],
        facts=batch.facts,
        occupancy=batch.occupancy.model_dump() if batch.occupancy else None,
        digest=batch.content_digest(),
        sender=Sender(nodes=who.nodes, token_id=who.token_id),
        policy=IngestPolicy(
            thresholds=settings.thresholds(batch.backend),
            hysteresis=settings.hysteresis(),
            drift=settings.drift(),
            api_url=settings.api_url,
            limits=IngestLimits(
                max_clock_skew=timedelta(seconds=settings.max_clock_skew_s),
                max_age=timedelta(days=settings.retention_raw_days),
                max_new_nodes=settings.max_new_nodes_per_batch,
                max_nodes=settings.max_nodes,
                max_new_nodes_per_token=settings.max_new_nodes_per_token,
                new_nodes_window=timedelta(seconds=settings.new_nodes_window_s))),
    ))
