"""``python -m minipaged serve``: the engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn, as vLLM).

    from minipaged.engine import LLM
    from minipaged.serving import start_server

    with start_server(LLM(), port=8000) as server:      # returns once /health answers
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        client.chat.completions.create(model=server.served_model_name, messages=[...])

The modules, named after vLLM's: ``async_engine`` (one thread steps the engine; asyncio handlers await their
outputs), ``protocol`` (request bodies, errors), ``serving_engine`` / ``serving_completion`` / ``serving_chat``
(the endpoints), ``api_server`` (the FastAPI app), ``metrics`` (``/metrics``), ``launcher`` (uvicorn in a thread),
``deadlines`` (uvicorn's protocol with deadlines for slow clients' headers and bodies).
"""

from .api_server import build_app
from .async_engine import AsyncEngine, EngineDeadError, EngineError
from .deadlines import DeadlineH11Protocol
from .launcher import ServerHandle, start_server

__all__ = [
    "AsyncEngine",
    "DeadlineH11Protocol",
    "EngineDeadError",
    "EngineError",
    "ServerHandle",
    "build_app",
    "start_server",
]
