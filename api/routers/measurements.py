"""Probe results in: ``POST /v1/measurements``."""

from datetime import timedelta

from fastapi import APIRouter, Request, Response
from sqlalchemy.orm import Session

from api.deps import AgentDep, SessionDep, SettingsDep
from api.schemas import IngestOut, MeasurementBatch
from services.config import Settings
from services.errors import Busy, TooLarge
from services.monitor.ingest import IngestResult, ingest_batch

router = APIRouter(prefix="/v1", tags=["measurements"])


@router.post("/measurements", response_model=IngestOut)
def post_measurements(batch: MeasurementBatch, request: Request, response: Response,
                      session: SessionDep, settings: SettingsDep, who: AgentDep) -> dict:
    """Store a batch of probe results once (a retried ``batch_id`` is a no-op, ``created: false``)
    and fold its judgement into link health and fault incidents.

    At most ``max_concurrent_ingests`` batches are stored at once; one that waits longer
    than ``ingest_wait_s`` for its turn is a 503 with Retry-After (the shipper keeps it
    spooled and sends it then)."""
    if len(batch.measurements) > settings.max_batch_measurements:
        raise TooLarge(f"{len(batch.measurements)} measurements in one batch; the limit is "
                       f"{settings.max_batch_measurements} (RINGWATCH_MAX_BATCH_MEASUREMENTS)")
    slots = request.app.state.ingest_slots
    if not slots.acquire(timeout=settings.ingest_wait_s):
        raise Busy(f"{settings.max_concurrent_ingests} batch(es) are being stored; "
                   "retry after the interval given", retry_after_s=5.0)
    try:
        result = _ingest(batch, session, settings, who.nodes)
    finally:
        slots.release()
    # Where the time went (store: nodes, groups, COPY; judge: health and incidents).
    response.headers["Server-Timing"] = ", ".join(
        f"{k};dur={v * 1000:.1f}" for k, v in result.timings.items())
    return result.to_dict()


def _ingest(batch: MeasurementBatch, session: Session, settings: Settings,
            allowed_nodes: frozenset[str] | None) -> IngestResult:
    result = ingest_batch(
        session,
        batch_id=batch.batch_id,
        backend=batch.backend,
        measurements=[m.model_dump(exclude={"stats"}) for m in batch.measurements],
        ranks=[r.model_dump() for r in batch.ranks],
        findings=[f.model_dump(exclude_none=True) for f in batch.findings],
        duty_cycle=batch.duty_cycle,
        skipped=batch.skipped,
        thresholds=settings.thresholds(batch.backend),
        hysteresis=settings.hysteresis(),
        drift=settings.drift(),
        api_url=settings.api_url,
        shipper=batch.shipper.model_dump() if batch.shipper else None,
        counters=[c.model_dump() for c in batch.counters],
        max_clock_skew=timedelta(seconds=settings.max_clock_skew_s),
        max_age=timedelta(days=settings.retention_raw_days),
        allowed_nodes=allowed_nodes,
    )
    return result
