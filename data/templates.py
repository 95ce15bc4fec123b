"""Chat templates for targets whose tokenizer has none, and the plain-text mode for base models.

`data.chat_template` names a Jinja file or one of NAMED_TEMPLATES; it replaces the tokenizer's
own. `data.plain_text` skips templates altogether: each row's text (a `text` field, or a
conversation's contents joined by blank lines) is tokenized as it is, between the tokenizer's
own begin and end tokens, and the loss covers every token after the first.
"""
from __future__ import annotations

from pathlib import Path

from data.sources import DataError

NAMED_TEMPLATES = {
    # ChatML as Qwen and SmolLM write it: <|im_start|>role\ncontent<|im_end|>\n
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    # a role-tagged plain layout, for base models with no special chat tokens: "Role:\n" then the
    # text, so that an answer's first token is the same whether the text follows (training) or the
    # model writes it after the generation prompt (after "Assistant: " the space would be merged
    # into the answer's first token in training and stand alone at inference). It opens with the
    # tokenizer's begin token where it has one: rendered text is tokenized without special
    # tokens, and a base model such as Gemma-3 is off its training distribution without it.
    "plain": ("{{ bos_token if bos_token else '' }}{% for message in messages %}"
              "{{ message['role'] | capitalize + ':\n' + message['content'] + '\n\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:\n' }}{% endif %}"),
}

NO_TEMPLATE_HINT = ("set data.chat_template to a Jinja file or a named template ({}) for chat data, or "
                    "data.plain_text=true to train on raw text (loss on every token)").format(", ".join(NAMED_TEMPLATES))


def template_source_problem(spec: str) -> str | None:
    """Why `spec` is not a usable data.chat_template (None when it is), without a tokenizer."""
    if spec in NAMED_TEMPLATES:
        return None
    path = Path(spec).expanduser()
    if not path.is_file():
        return f"{spec!r} is neither a named template ({', '.join(NAMED_TEMPLATES)}) nor an existing Jinja file"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return f"{spec} is unreadable ({e})"
    if "messages" not in text:
        return f"{spec} does not look like a chat template (it never reads `messages`)"
    return None


def apply_template_choice(tokenizer, chat_template: str | None, plain_text: bool, target: str) -> None:
    """Set the tokenizer's chat template from data.chat_template, or refuse chat data for a
    tokenizer without one (DataError with the way forward)."""
    if plain_text:
        return
    if chat_template is not None:
        problem = template_source_problem(chat_template)
        if problem:
            raise DataError(f"data.chat_template: {problem}")
        tokenizer.chat_template = NAMED_TEMPLATES.get(chat_template) or Path(chat_template).expanduser().read_text(encoding="utf-8")
        return
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"target {target}: its tokenizer has no chat template; {NO_TEMPLATE_HINT}")


def row_text(messages: list[dict]) -> str:
    """Plain-text mode: a row's text (rows with a `text` field arrive as one message)."""
    return "\n\n".join(m["content"] for m in messages)


def tokenize_text(tokenizer, text: str, max_length: int) -> dict:
    """{'input_ids', 'loss_mask'}: the text between the tokenizer's begin and end tokens, loss
    on every token but the first (nothing precedes it)."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    ids = ids[:max_length]
    return {"input_ids": ids, "loss_mask": [0] + [1] * (len(ids) - 1) if ids else []}


def trained_template(tokenizer, export_folders, target: str) -> None:
    """Serving side: the tokenizer takes the chat template the drafter at export_folders (the
    first that records one) was trained with (draftsmith.json: training_config.data
    .chat_template), as training replaced the tokenizer's own with it; so a base model's prompts
    render as its training data did. Unchanged when no export records one."""
    import json

    for folder in export_folders:
        try:
            record = json.loads((Path(folder) / "draftsmith.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        chosen = ((record.get("training_config") or {}).get("data") or {}).get("chat_template")
        if chosen:
            apply_template_choice(tokenizer, chosen, False, target)
            return
