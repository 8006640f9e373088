"""The API's browsable description at /docs: Swagger UI served from this API (api/swagger),
its script and stylesheet under /docs/assets, started from a script file. Nothing is
fetched from elsewhere and nothing runs inline, so the page works on a cluster with no
internet access and under the Content-Security-Policy of api/headers.py. Public, like
/openapi.json, which it reads."""

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from ringwatch.api.auth import DOCS_ASSETS_PREFIX, DOCS_PATH

SWAGGER_DIR = Path(__file__).resolve().parents[1] / "swagger"

router = APIRouter(include_in_schema=False)


@router.get(DOCS_PATH)
def docs() -> FileResponse:
    return FileResponse(SWAGGER_DIR / "index.html", media_type="text/html")


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount(DOCS_ASSETS_PREFIX, StaticFiles(directory=SWAGGER_DIR), name="docs-assets")
