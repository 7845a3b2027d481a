"""What prefix affinity follows: the first characters of the prompt as the engine sees it begin."""

from __future__ import annotations

from kvpilot.gateway.prefix import RecentPrefixes, affinity_key, prompt_prefix

SYSTEM = "You are a careful assistant. " * 20  # 580 characters


def _chat(system: str, user: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_chats_sharing_a_long_system_prompt_share_a_key():
    assert affinity_key(_chat(SYSTEM, "What is 2+2?"), 256) == affinity_key(_chat(SYSTEM, "Name a city."), 256)


def test_chats_with_different_system_prompts_differ():
    assert affinity_key(_chat(SYSTEM, "q"), 256) != affinity_key(_chat("Be brief. " + SYSTEM, "q"), 256)


def test_short_prompts_are_keyed_whole_and_the_model_is_part_of_the_key():
    assert affinity_key({"model": "m", "prompt": "Hello"}, 256) != affinity_key({"model": "m", "prompt": "Hello!"}, 256)
    assert affinity_key({"model": "a", "prompt": "Hello"}, 256) != affinity_key({"model": "b", "prompt": "Hello"}, 256)


def test_completion_prompts_strings_lists_and_token_ids():
    assert prompt_prefix({"prompt": "abcdef"}, 3) == "abc"
    assert prompt_prefix({"prompt": ["abcdef", "zzz"]}, 4) == "abcd"
    assert prompt_prefix({"prompt": [1, 2, 3, 4]}, 2) == "1,2"
    assert prompt_prefix({"prompt": []}, 4) is None and prompt_prefix({"prompt": ""}, 4) is None


def test_chat_content_parts_are_read_as_text():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]}
    assert prompt_prefix(body, 100) == "user\nhi there\n"


def test_zero_chars_or_no_prompt_means_no_affinity():
    assert affinity_key({"model": "m", "prompt": "Hello"}, 0) is None
    assert affinity_key({"model": "m"}, 256) is None


def test_recent_prefixes_remember_the_last_pod_and_forget_the_least_recent():
    recent = RecentPrefixes(capacity=2)
    recent.record(b"a", "ns/pod-0")
    recent.record(b"b", "ns/pod-1")
    recent.record(b"a", "ns/pod-1")  # a is now the most recent, on its new pod
    recent.record(b"c", "ns/pod-0")  # b, the least recent, is forgotten
    assert [recent.last_pod(k) for k in (b"a", b"b", b"c")] == ["ns/pod-1", None, "ns/pod-0"]
