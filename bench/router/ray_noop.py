"""Ray Serve 2.60 no-op deployment for the router benchmark (bench/router/run.sh).

Answers POST / with a fixed OpenAI-shaped completion, doing no work, so the measured
latency is Ray Serve's proxy + replica overhead only.
"""
import os
import signal
import sys
import time

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

REPLY = {
    "id": "cmpl-noop", "object": "text_completion", "created": 0, "model": "mock",
    "choices": [{"index": 0, "text": "t0 ", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


@serve.deployment(max_ongoing_requests=1000)
class NoOp:
    async def __call__(self, request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(REPLY)


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8001
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(NoOp.bind(), route_prefix="/", name="noop")
    def stop(*_):
        serve.shutdown()
        ray.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("READY", flush=True)
    while True:
        time.sleep(3600)
