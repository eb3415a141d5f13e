"""The server's OpenAPI document (`GET /openapi.json`), with the request bodies the routes
read themselves (they parse raw JSON so that body size, nesting and field errors are theirs
to report): the native /generate body, the OpenAI models, /abort_request, /tokenize and
/detokenize.

The schemas describe the shapes, not every bound: values outside the documented ranges are
part of what a client may send, and get a 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, create_model

from plait.sampling import SamplingParams
from plait.server.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


def _sampling_model() -> type[BaseModel]:
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        kind = hints[f.name]
        if f.name in ("json_schema", "structural_tag"):
            kind = str | dict[str, Any] | None
        elif f.name == "stop":
            kind = str | list[str] | None
        fields[f.name] = (kind | None, None)
    return create_model("SamplingParamsBody", __config__=ConfigDict(extra="forbid"), **fields)


SamplingParamsBody = _sampling_model()


class GenerateBody(BaseModel):
    """SGLang's /generate body: one prompt or a batch; per-prompt fields may be lists."""

    model_config = ConfigDict(extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None  # type: ignore[valid-type]
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    priority: int | None = None


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    abort_all: bool = False


BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateBody,
    "/abort_request": AbortBody,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def install_openapi(app: FastAPI) -> None:
    """Replace app.openapi with one that adds the request bodies the routes parse."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = base()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            for method in ("post", "put"):
                op = doc["paths"].get(path, {}).get(method)
                if op is not None:
                    op["requestBody"] = {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                            }
                        },
                    }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
