"""The `chat` template: the AZR prompts as one user turn in the tokenizer's chat template."""

import pytest
from transformers import AutoTokenizer

from lorapop.engine.load import TINY_DIR
from lorapop.tasks import get_family
from lorapop.tasks.prompts import chat_format
from lorapop.tasks.task import Outcome, Task

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture
def tokenizer():
    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    tok.chat_template = CHAT
    return tok


TASK = Task("code_o", "def f(x):\n    return x + 1", ("2",), ("3",))


def test_chat_wraps_the_azr_body(tokenizer):
    chat = get_family("code_o", template="chat", chat=chat_format(tokenizer))
    azr = get_family("code_o", template="azr")
    prompt = chat.student_prompt(TASK)
    assert prompt.startswith("<|user|>\nFirst reason step by step inside <think> </think>")
    assert prompt.endswith("<|end|>\n<|assistant|>\n")
    body = azr.student_prompt(TASK).split("User: ", 1)[1].rsplit("\nAssistant:", 1)[0]
    assert body in prompt and "Assistant: <think>" not in prompt
    teacher = chat.teacher_prompt([TASK])
    assert teacher.startswith("<|user|>") and "```python" in teacher


def test_chat_answers_parse_as_azr(tokenizer, sandbox):
    fam = get_family("code_o", template="chat", chat=chat_format(tokenizer))
    grades = fam.check([TASK, TASK], ["<think>2+1</think> <answer>3</answer>", "3"], sandbox)
    assert [g.outcome for g in grades] == [Outcome.CORRECT, Outcome.FORMAT_ERROR]


def test_code_f_chat(tokenizer):
    fam = get_family("code_f", template="chat", chat=chat_format(tokenizer), n_inputs=4)
    base = fam.seed_tasks()[0]
    assert fam.teacher_prompt([], base).startswith("<|user|>")


def test_tokenizer_without_chat_template_is_a_clear_error():
    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    tok.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        chat_format(tok)
    with pytest.raises(ValueError, match="needs chat="):
        get_family("code_i", template="chat")
