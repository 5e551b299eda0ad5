"""A request that leaves max_new_tokens to its default gets what fits in the model's context (a long
chat's later turns), while a number the client gave that does not fit stays a 400 naming it."""
from __future__ import annotations

import pytest

from inference.tokenizers import tokenizer_for
from metadata.models import Session

URL = "/api/v1/generations/"


def prompt_leaving(tiny_model, room: int) -> str:
    """A prompt that leaves about ``room`` tokens of the tiny model's context (1024)."""
    tokenizer = tokenizer_for(str(tiny_model.directory))
    line = "def f(x):\n    return x\n"
    prompt = ""
    while len(tokenizer(prompt + line)["input_ids"]) <= tiny_model.context_length - room:
        prompt += line
    return prompt


@pytest.mark.django_db
def test_the_default_shrinks_to_the_room_the_prompt_leaves(api_client, tiny_model):
    prompt = prompt_leaving(tiny_model, 20)

    response = api_client.post(URL, {"prompt": prompt}, format="json")

    assert response.status_code == 202, response.content
    session = Session.objects.get()
    assert 0 < session.params["max_new_tokens"] < 64
    assert session.prompt_tokens + session.params["max_new_tokens"] == tiny_model.context_length


@pytest.mark.django_db
def test_a_max_new_tokens_given_that_does_not_fit_is_a_400_naming_it(api_client, tiny_model):
    prompt = prompt_leaving(tiny_model, 20)

    response = api_client.post(URL, {"prompt": prompt, "max_new_tokens": 64}, format="json")

    assert response.status_code == 400
    assert "accepts at most 1024 tokens in all" in response.json()["max_new_tokens"][0]
    assert Session.objects.count() == 0
