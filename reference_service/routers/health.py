"""``GET /health`` (live; says whether the model is loaded) and ``GET /ready`` (503 until the
model is loaded and warmed). ``GET /metrics`` is the instrumentation library's endpoint, added
in ``main.py``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = request.app.state.mrc
    vlm = state.vlm
    return {
        "status": "ok",
        "model_loaded": vlm is not None,
        "model": state.loading,
        "load_error": state.load_error,
        "meaningful_answers": None if vlm is None else vlm.meaningful,
    }


@router.get("/ready")
async def ready(request: Request) -> Response:
    state = request.app.state.mrc
    if state.ready:
        return JSONResponse({"ready": True})
    return JSONResponse({"ready": False, "model": state.loading}, status_code=503,
                        headers={"Retry-After": "5"})
