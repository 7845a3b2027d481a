"""LoRA adapters: read from PEFT folders, batched per row on top of dense or packed projections.

The truth for an adapter is the base model with the adapter merged into its weights
(W + scale·B·A), loaded as a plain model: greedy output with the adapter applied per row must
equal greedy output of that merged model, alone or batched with other adapters and the base
model, with fewer slots than adapters, with preemption and with speculative decoding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpilot.engine import LLM, InvalidRequestError, SamplingParams
from kvpilot.engine.linear import DenseLinear
from kvpilot.engine.lora import LoRAError, LoRARequest
from kvpilot.engine.lora.layer import LoRALinear, LoRAMapping
from kvpilot.engine.model_files import make_lora_adapter
from kvpilot.engine.quantization.linear import QuantizedLinear
from kvpilot.engine.quantization.packed import PackedWeight
from kvpilot.kernels import cpu_features
from kvpilot.kernels.lora_bgmv import lora_bgmv

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 301, 42, 99, 7], [1000, 3, 3, 250, 11], [64, 65, 66, 67, 68, 69, 70, 71, 72]]


def merge_adapter(model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """The base model with the adapter folded into its weights: W + scale·B·A."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    shutil.copytree(model_dir, out_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for name, a in adapter.items():
        if ".lora_A." in name:
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[name.replace("lora_A", "lora_B")]
            weights[f"{module}.weight"] = weights[f"{module}.weight"] + scale * (b @ a)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory):
    """arch -> {"a": (LoRARequest, merged model dir), "b": ...}: two full adapters, one of rank 4 on q
    and v only with rsLoRA scaling, one on the MLP only."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for arch in ("llama", "qwen2"):
        model_dir = tiny_model_dirs[arch]
        kinds = {
            "a": {"rank": 8, "seed": 1},
            "b": {"rank": 16, "alpha": 8, "seed": 2},
            "qv": {"rank": 4, "target_modules": ("q_proj", "v_proj"), "use_rslora": True, "seed": 3},
            "mlp": {"rank": 8, "target_modules": ("gate_proj", "up_proj", "down_proj"), "seed": 4},
        }
        out[arch] = {}
        for index, (name, kwargs) in enumerate(kinds.items(), start=1):
            folder = make_lora_adapter(root / arch / name, model_dir, **kwargs)
            merged = merge_adapter(model_dir, folder, root / arch / f"{name}-merged")
            out[arch][name] = (LoRARequest(name, index, str(folder)), merged)
    return out


def greedy_tokens(llm: LLM, prompts, lora_request=None, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)]


@pytest.fixture(scope="module")
def references(tiny_model_dirs, adapters):
    """arch -> {None: base greedy tokens, adapter name: merged model's greedy tokens} over PROMPTS."""
    out = {}
    for arch in ("llama", "qwen2"):
        out[arch] = {None: greedy_tokens(LLM(str(tiny_model_dirs[arch]), dtype="float32"), PROMPTS)}
        for name, (_, merged) in adapters[arch].items():
            out[arch][name] = greedy_tokens(LLM(str(merged), dtype="float32"), PROMPTS)
            assert out[arch][name] != out[arch][None], f"adapter {name} does not change the output"
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapters_alone_and_mixed_in_one_batch_match_their_merged_models(arch, tiny_model_dirs, adapters, references):
    llm = LLM(str(tiny_model_dirs[arch]), dtype="float32", enable_lora=True, max_loras=4)
    for name, (request, _) in adapters[arch].items():
        assert greedy_tokens(llm, PROMPTS, request) == references[arch][name], name
    # Every prompt under every adapter and the base model, all admitted in the first step.
    names = [None, *adapters[arch]]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else adapters[arch][n][0] for _ in PROMPTS for n in names]
    tokens = greedy_tokens(llm, prompts, loras)
    expected = [references[arch][n][i] for i in range(len(PROMPTS)) for n in names]
    assert tokens == expected


@pytest.mark.parametrize(("arch", "use_rslora"), [("llama", False), ("mistral", True), ("qwen2", False)])
def test_adapters_made_with_peft_match_transformers_with_peft(arch, use_rslora, tiny_model_dirs, tmp_path):
    """An adapter as PEFT writes it (random B instead of PEFT's zeros, so it changes the output):
    kvpilot's greedy tokens and top log-probabilities equal transformers running it through peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[arch]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=32, use_rslora=use_rslora, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(hf, config).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft_model.save_pretrained(str(tmp_path / "adapter"))

    llm = LLM(str(model_dir), dtype="float32", enable_lora=True)
    request = LoRARequest("peft", 1, str(tmp_path / "adapter"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=request)
    base = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in base]
    for prompt, output in zip(PROMPTS, outputs):
        with torch.inference_mode():
            expected = peft_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
            first = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        assert list(output.outputs[0].token_ids) == expected[0, len(prompt):].tolist()
        top = output.outputs[0].logprobs[0]
        for token_id, logprob in top.items():
            assert logprob == pytest.approx(float(first[token_id]), abs=1e-3)


def test_more_adapters_than_slots_with_preemption(tiny_model_dir, adapters, references):
    """Two slots for four adapters and a KV cache too small for the batch: sequences wait for their
    adapter's slot, get preempted and recomputed, and still match their merged models."""
    block_bytes = 2 * 16 * 2 * 2 * 32 * 4  # K and V of 16 tokens, 2 layers, 2 KV heads of 32, float32
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=2, block_size=16,
              max_model_len=128, kv_cache_memory=10 * block_bytes)
    names = ["a", "b", None, "qv", "mlp", "a", "mlp"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    loras = [None if n is None else adapters["llama"][n][0] for n in names]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    tokens = greedy_tokens(llm, prompts, loras, params)
    for i, name in enumerate(names):
        assert tokens[i][:12] == references["llama"][name][i % len(PROMPTS)], (i, name)
    engine = llm.llm_engine
    assert engine.runner.lora.num_slot_loads >= 4
    assert engine.scheduler.num_preemptions > 0


def test_speculative_decoding_verifies_with_the_adapter(tiny_model_dir, adapters):
    """Proposals (prompt lookup, no adapter involved) are verified by the model with the row's
    adapter, so the output is the merged model's."""
    request, merged = adapters["llama"]["a"]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "disable_by_batch_size": 64})
    assert greedy_tokens(llm, PROMPTS, request, params) == greedy_tokens(LLM(str(merged), dtype="float32"), PROMPTS,
                                                                         params=params)
    assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(tiny_model_dir, adapters):
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=2, block_size=16)
    prompt = list(range(100, 150))  # three full blocks
    a, b = adapters["llama"]["a"][0], adapters["llama"]["b"][0]
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(lora):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0
    assert cached(None) == 0
    assert cached(a) == 48
    assert cached(None) == 48


def test_lora_linear_adds_each_rows_adapter_over_dense_and_packed_weights():
    gen = torch.Generator().manual_seed(0)
    codes = PackedWeight.from_codes(torch.randint(-128, 128, (96, 256), generator=gen),
                                    0.01 * torch.rand(96, 8, generator=gen), None, bits=8, group_size=32)
    packed = QuantizedLinear(codes, torch.float32, torch.device("cpu"))
    dense = DenseLinear(torch.randn(96, 256, generator=gen), None)
    for base in (dense, packed):
        layer = LoRALinear(base, (64, 32), max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
        pairs = {slot: {part: (torch.randn(rank, 256, generator=gen), torch.randn(size, rank, generator=gen))
                        for part, size in enumerate((64, 32))}
                 for slot, rank in ((0, 8), (1, 3))}
        for slot, parts in pairs.items():
            layer.set_slot(slot, parts, rank=parts[0][0].shape[0])
        layer.set_slot(1, {1: pairs[1][1]}, rank=3)  # slot 1: part 1 only
        x = torch.randn(5, 256, generator=gen)
        row_slots = [1, None, 0, 1, 0]
        expected = base(x)
        for row, slot in enumerate(row_slots):
            for part, (a, b) in pairs.get(slot, {}).items():
                if slot == 1 and part == 0:
                    continue
                rows = slice(layer.part_offsets[part], layer.part_offsets[part + 1])
                expected[row, rows] += x[row] @ a.T @ b.T
        mapping = LoRAMapping.from_row_slots(row_slots, torch.device("cpu"))
        got = layer(x, mapping)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
        # The CUDA path's kernels (here under Triton's interpreter) read the slots the same way.
        through_kernel = base(x)
        lora_bgmv(x, through_kernel, layer.lora_a, layer.lora_b.transpose(0, 1), mapping.row_slots,
                  layer.widths_on_device)
        torch.testing.assert_close(through_kernel, expected, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(layer(x[[0, 3]], LoRAMapping.from_row_slots([1, 1], torch.device("cpu"))),
                                   expected[[0, 3]], rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(layer(x), base(x))


def broken(folder: Path, out: Path, *, config: dict | None = None, tensors=None, raw: bytes | None = None) -> str:
    shutil.copytree(folder, out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        path = out / "adapter_model.safetensors"
        save_file(tensors(load_file(str(path))), str(path))
    if raw is not None:
        (out / "adapter_model.safetensors").write_bytes(raw)
    return str(out)


def _drop_one_b(tensors):
    del tensors[next(k for k in tensors if "lora_B" in k)]
    return tensors


def _lm_head(tensors):
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 128)
    return tensors


def _wrong_base(tensors):
    return {k: torch.zeros(v.shape[0], v.shape[1] * 2) if "lora_A" in k else v for k, v in tensors.items()}


@pytest.mark.parametrize(("change", "message"), [
    ({"config": {"r": 32}}, "r=32 is above max_lora_rank=16.*--max-lora-rank"),
    ({"config": {"use_dora": True}}, "use_dora.*DoRA"),
    ({"config": {"bias": "all"}}, "bias.*'none'"),
    ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    ({"config": {"target_modules": ["q_proj", "lm_head"]}}, r"target_modules \['lm_head'\]"),
    ({"config": {"peft_type": "IA3"}}, "peft_type"),
    ({"config": {"rank_pattern": {"q_proj": 4}}}, "rank_pattern"),
    ({"tensors": _drop_one_b}, "no lora_B tensor"),
    ({"tensors": _lm_head}, "lm_head.lora_A.*does not adapt embeddings, the LM head"),
    ({"tensors": _wrong_base}, "trained for another base model"),
    ({"raw": b"\x00" * 40}, "cannot be read.*corrupt"),
], ids=["rank", "dora", "bias", "modules_to_save", "target_modules", "peft_type", "rank_pattern", "missing_b",
        "lm_head", "base_model", "corrupt"])
def test_bad_adapters_are_refused_naming_the_field_and_the_rest_keep_serving(change, message, lora_llm, adapters,
                                                                             tmp_path):
    good, _ = adapters["llama"]["a"]
    path = broken(Path(good.lora_path), tmp_path / "bad", **change)
    with pytest.raises(LoRAError, match=message) as raised:
        lora_llm.llm_engine.add_lora(LoRARequest("bad", 99, path))
    assert "'bad'" in str(raised.value)
    assert [a.name for a in lora_llm.llm_engine.list_loras()] == ["a"]
    assert greedy_tokens(lora_llm, PROMPTS[:1], good)


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir, adapters):
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True)
    llm.llm_engine.add_lora(adapters["llama"]["a"][0])
    return llm


def test_adapter_names_ids_and_folders(lora_llm, adapters, tmp_path):
    engine = lora_llm.llm_engine
    a, b = adapters["llama"]["a"][0], adapters["llama"]["b"][0]
    assert engine.add_lora(a) is engine.add_lora(LoRARequest("a", 77, a.lora_path))  # a racing second load
    with pytest.raises(LoRAError, match="already loaded from .*unload it"):
        engine.add_lora(LoRARequest("a", a.lora_int_id, b.lora_path))
    with pytest.raises(LoRAError, match="lora_int_id 1 is already 'a'"):
        engine.add_lora(LoRARequest("other", a.lora_int_id, b.lora_path))
    with pytest.raises(LoRAError, match="not a folder"):
        engine.add_lora(LoRARequest("missing", 7, str(tmp_path / "nowhere")))
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        engine.add_lora(LoRARequest("empty", 7, str(tmp_path)))
    with pytest.raises(LoRAError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, a.lora_path)
    engine.add_lora(b)
    assert engine.remove_lora("b").name == "b"
    with pytest.raises(LoRAError, match="'b' is not loaded; loaded: a"):
        engine.remove_lora("b")


def test_an_engine_without_lora_says_how_to_turn_it_on(tiny_model_dir, adapters):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters["llama"]["a"][0])
    assert not llm.llm_engine.has_unfinished_requests()


def test_bfloat16_adapters_on_a_cpu_with_and_without_avx512(tiny_model_dir, adapters, cpu_without):
    """The adapters' stacked matrices take oneDNN's packed layout where the base weights do (AVX-512
    BW/VL/DQ) and stay plain elsewhere; both give the same greedy tokens."""
    request = adapters["llama"]["a"][0]

    def run():
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", enable_lora=True, max_loras=2)
        layer = llm.llm_engine.runner.model.layers[0].qkv_proj
        return greedy_tokens(llm, PROMPTS, [request, None, request]), layer._shrink.onednn_weight is not None

    packs_here = cpu_features.detect().onednn_bf16_prepack  # this CPU, less what KVPILOT_CPU_FEATURES removes
    native, packed = run()
    cpu_without("avx512f", "avx_ne_convert")
    plain, packed_without = run()
    assert not packed_without
    assert plain == native
    assert packed == packs_here
