"""The OpenAI server on a real trained model (SmolLM2-135M-Instruct, from its GGUF file alone)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# Asked bare, the first token is a near-tie (float32, dequantized: "The" 25.33, "L" 25.24, "La"
# 24.94), which x rounded to 8 bits (the int8-activation kernel, the default on AVX2 and AVX-512 CPUs)
# tips to "L'Étoile, ..." on some CPUs; asked for one sentence, every path says Paris.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    import openai

    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_answers_a_factual_question(client, smollm2_gguf):
    from transformers import AutoTokenizer

    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    (choice,) = reply.choices
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"  # the model ended its turn with <|im_end|>
    # The prompt is the file's ChatML template (SmolLM2's default system prompt included), as
    # transformers renders and tokenizes it from the same file.
    reference = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    prompt_ids = reference.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert reply.usage.prompt_tokens == len(prompt_ids)


def test_streamed_chat_says_the_same(client):
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_completion_continues_a_fact(client):
    reply = client.completions.create(model="smollm2", prompt="The capital of France is", temperature=0,
                                      max_tokens=4)
    assert reply.choices[0].text.startswith(" Paris"), reply.choices[0].text


def test_models_lists_the_gguf_model(client, smollm2_gguf):
    (model,) = client.models.list().data
    assert model.id == "smollm2"
