"""The HTTP server process (`plait serve`): the FastAPI app and its routes.

    http_server.py    the app, its lifespan and the plain routes; launch_server (start the
                      children, then serve until SIGINT/SIGTERM)
    native_api.py     SGLang's native routes: /generate, /get_server_info, /flush_cache, ...
    openai_api.py     /v1/completions, /v1/chat/completions, /v1/models
    http_common.py    what every route shares: body reading, admission (queue slots, API keys,
                      rate limits), SSE streaming, disconnect aborts, error bodies
    openapi.py        the /openapi.json document
    router_compat.py  the fields SGLang's router adds to requests
    metrics.py        /metrics (Prometheus)
    replicas.py       `plait serve --dp N`: N server processes behind SGLang's router

The tokenizer manager this process runs is in plait/tokenizer/; the children it starts
(scheduler, detokenizer) are launched by plait/launch.py.
"""
