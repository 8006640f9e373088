"""The web page at /ui: a static shell (HTML, JS and CSS, no build step) that reads the
API with the token its user types. The shell is public; every figure it shows comes
through the reader-role routes, as any other client's would."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from ringwatch.api.auth import UI_PREFIX

UI_DIR = Path(__file__).resolve().parents[1] / "ui"


def mount(app: FastAPI) -> None:
    app.mount(UI_PREFIX, StaticFiles(directory=UI_DIR, html=True), name="ui")
