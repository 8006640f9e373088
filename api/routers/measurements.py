"""Probe results in: ``POST /v1/measurements``."""

from fastapi import APIRouter

from api.deps import AgentDep, SessionDep, SettingsDep
from api.schemas import IngestOut, MeasurementBatch
from services.monitor.ingest import ingest_batch

router = APIRouter(prefix="/v1", tags=["measurements"])


@router.post("/measurements", response_model=IngestOut)
def post_measurements(batch: MeasurementBatch, session: SessionDep, settings: SettingsDep,
                      _: AgentDep) -> dict:
    """Store a batch of probe results once (a retried ``batch_id`` is a no-op, ``created: false``)
    and fold its judgement into link health and fault incidents."""
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
        api_url=settings.api_url,
    )
    return result.to_dict()
