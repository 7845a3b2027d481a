"""LoRA adapters through the OpenAI API: named in `model`, listed by /v1/models with their parent,
loaded and unloaded live on the admin port (vLLM's bodies), counted per adapter in /metrics; a bad
adapter is refused naming it while the rest keep serving."""

from __future__ import annotations

import json
import shutil
import sys

import httpx
import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.lora import LoRARequest
from kvpilot.engine.model_files import make_lora_adapter

ADMIN_TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPT = [5, 17, 301, 42, 99, 7]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_lora_adapter(root / name, tiny_model_dir, rank=8, seed=seed))
            for seed, name in enumerate(("sql", "chat"), start=1)}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """Greedy text of PROMPT offline, for the model and for each adapter."""
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    text = {None: llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for index, (name, path) in enumerate(adapters.items(), start=1):
        text[name] = llm.generate([PROMPT], params, use_tqdm=False,
                                  lora_request=LoRARequest(name, index, path))[0].outputs[0].text
    assert len(set(text.values())) == 3, "the adapters must change the output"
    return text


@pytest.fixture(scope="module")
def live(live_server_factory, adapters):
    server = live_server_factory(admin_token=ADMIN_TOKEN, engine={"dtype": "float32", "enable_lora": True,
                                                                 "max_loras": 2, "max_num_seqs": 8})
    loaded = httpx.post(f"{server.admin_url}/v1/load_lora_adapter", headers=ADMIN, timeout=60,
                        json={"lora_name": "sql", "lora_path": adapters["sql"]})
    assert loaded.status_code == 200, loaded.text
    return server


def _complete(live, model: str) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True})


def test_an_adapter_is_a_model_clients_name(live, expected):
    models = httpx.get(f"{live.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("sql", "tiny")]
    for model, adapter in (("tiny", None), ("sql", "sql")):
        answer = _complete(live, model).json()
        assert answer["model"] == model and answer["choices"][0]["text"] == expected[adapter]
    chat = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
        "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    chunks = [json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(c["model"] == "sql" for c in chunks)
    missing = _complete(live, "nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The model `nope` does not exist; this server serves `tiny`, `sql`."


def test_adapters_load_and_unload_live_on_the_admin_port(live, adapters, expected, tmp_path):
    admin = httpx.Client(base_url=live.admin_url, headers=ADMIN, timeout=60)
    assert _complete(live, "chat").status_code == 404
    loaded = admin.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapters["chat"]})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert _complete(live, "chat").json()["choices"][0]["text"] == expected["chat"]
    assert [a["name"] for a in admin.get("/admin/v1/lora_adapters").json()["data"]] == ["chat", "sql"]

    again = admin.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapters["chat"]})
    assert again.status_code == 200  # the same adapter again: idempotent, so racing syncs both succeed
    elsewhere = admin.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapters["sql"]})
    assert elsewhere.status_code == 400 and "already loaded from" in elsewhere.json()["error"]["message"]
    broken = tmp_path / "broken"
    shutil.copytree(adapters["chat"], broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    refused = admin.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(broken)})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "lora_path"
    assert "adapter 'big'" in error["message"] and "r=64 is above max_lora_rank=16" in error["message"]
    assert _complete(live, "sql").json()["choices"][0]["text"] == expected["sql"]  # the rest keep serving

    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    assert _complete(live, "chat").status_code == 404
    gone = admin.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert gone.status_code == 404 and gone.json()["error"]["message"].endswith("loaded: `sql`")
    assert admin.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": adapters["chat"]}
                      ).status_code == 400  # the served model's own name
    unauthorized = httpx.post(f"{live.admin_url}/v1/load_lora_adapter", timeout=60,
                              json={"lora_name": "x", "lora_path": adapters["chat"]})
    assert unauthorized.status_code == 401
    assert httpx.post(f"{live.url}/v1/load_lora_adapter", headers=ADMIN,
                      json={"lora_name": "x", "lora_path": adapters["chat"]}).status_code == 404  # admin port only


def test_metrics_count_each_adapter_and_forget_an_unloaded_one(live, adapters):
    def series(name: str) -> dict[str, float]:
        page = httpx.get(f"{live.url}/metrics").text
        return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                if line.startswith(name + "{")}

    admin = httpx.Client(base_url=live.admin_url, headers=ADMIN, timeout=60)
    admin.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapters["chat"]})
    before = series("kvpilot_lora_requests_total").get("sql", 0.0)
    for model in ("sql", "chat", "tiny"):
        assert _complete(live, model).status_code == 200
    live.wait_idle()
    assert series("kvpilot_lora_requests_total")["sql"] == before + 1
    assert series("kvpilot_lora_generation_tokens_total")["chat"] >= 10
    admin.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert "chat" not in series("kvpilot_lora_requests_total")


def test_kvpilot_serve_lora_modules(tiny_model_dir, adapters, serve_process, tmp_path):
    server = serve_process([sys.executable, "-m", "kvpilot"], [
        str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
        "--served-model-name", "tiny", "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}"])
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        ("tiny", None, str(tiny_model_dir)), ("chat", "tiny", adapters["chat"]), ("sql", "tiny", adapters["sql"])]
