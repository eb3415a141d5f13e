"""The 200 JSONSchemaBench dev schemas through a real server: each is either accepted and every
finished output validates, or refused with a 400 that names the reason; no 5xx, no hang."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

import plait

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "jsonschemabench-dev"
SCHEMAS = sorted(DATA.glob("*/*.json")) if DATA.is_dir() else []


@pytest.mark.skipif(not SCHEMAS, reason=f"no schemas at {DATA}")
def test_dev_schemas_through_the_server(tiny_llama):
    with plait.Runtime(tiny_llama, max_total_tokens=65536, grammar_compile_timeout=10.0) as rt:
        results = asyncio.run(_run_all(rt.url))
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 400]
    assert len(accepted) + len(refused) == len(SCHEMAS), [r for r in results if r["status"] not in (200, 400)]
    for r in refused:
        assert r["error"]["param"] == "json_schema" or "json_schema" in r["error"]["message"], r
    for r in accepted:
        reason = r["meta_info"]["finish_reason"]
        if reason["type"] == "stop":
            instance = json.loads(r["text"])
            cls = jsonschema.validators.validator_for(r["schema"])
            cls(r["schema"], format_checker=cls.FORMAT_CHECKER).validate(instance)
        else:
            assert reason["type"] == "length" and r["meta_info"].get("incomplete") is True, r
    assert len(accepted) >= len(SCHEMAS) // 2


async def _run_all(url: str) -> list[dict]:
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        return await asyncio.gather(*(_one(client, sem, path, i) for i, path in enumerate(SCHEMAS)))


async def _one(client, sem, path: Path, seed: int) -> dict:
    schema = json.loads(path.read_text())
    body = {"text": "Output JSON:", "sampling_params": {
        "max_new_tokens": 64, "temperature": 1.0, "seed": seed, "json_schema": json.dumps(schema)}}
    async with sem:
        resp = await client.post("/generate", json=body)
    out = resp.json()
    return {"path": str(path), "schema": schema, "status": resp.status_code, **(
        {"text": out["text"], "meta_info": out["meta_info"]} if resp.status_code == 200
        else {"error": out.get("error", out)})}
