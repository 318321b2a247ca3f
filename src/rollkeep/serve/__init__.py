"""`rollkeep serve`: a small inference server with vLLM's or SGLang's routes, generating
with the hf engine (docs/server-mode.md; the wire contract is the one `engine.name:
remote` speaks).

    body      request bodies, bounded and parsed once into a typed GenParams (4xx otherwise)
    service   the engine, live requests, pause, aborts, weight reloads and version labels
    http      what both flavors' routes share: one generation answered whole or streamed
    vllm      the vLLM flavor's routes and response shapes
    sglang    the SGLang flavor's routes and response shapes
    app       the FastAPI app of a flavor, errors as JSON
    process   the process: load, bind, announce, serve, stop on a signal or the parent's exit
"""
