"""The chat template each family's tokenizer carries, as the family's hub checkpoints ship it.

A family row (:mod:`notebookkit.families`) names its template here (``Family.tokenizer_template``,
``Vision.tokenizer_template``); the embedded default writes it into the tiny tokenizers
(:mod:`notebookkit.embedded.generate_tokenizer`, :mod:`notebookkit.embedded.generate_vision_models`).
These are the *shipped* formats a user's checkpoint arrives with, written for notebookkit with the
public markers of each family; the formats :func:`notebookkit.data.get_chat_template` attaches are
notebookkit's own (:mod:`notebookkit.data.chat_templates`) and differ in details (the shipped Gemma
and Mistral ones refuse roles that do not alternate; notebookkit's fold a system turn in instead).

Pieces that several templates share are written once below. This module imports nothing.
"""

from __future__ import annotations

#: Gemma's and Mistral's rule: user and assistant turns alternate, starting with the user.
_ROLES_ALTERNATE = (
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
)
#: Qwen's default system turn, written when the conversation has none.
_QWEN_DEFAULT_SYSTEM = "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
#: ChatML's prompt for the assistant's answer.
_CHATML_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
#: Gemma's turn loop up to the turn's content: the system text prefixes the first user turn.
_GEMMA_TURN_OPEN = (
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    + _ROLES_ALTERNATE
    + "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
)
_GEMMA_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"

LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_CHATML_TURNS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)

QWEN2 = (
    "{%- if messages[0]['role'] != 'system' %}"
    + _QWEN_DEFAULT_SYSTEM
    + "{%- endif %}"
    + _CHATML_TURNS
    + _CHATML_GENERATION_PROMPT + "{%- endif %}"
)

QWEN3 = (
    _CHATML_TURNS
    + _CHATML_GENERATION_PROMPT
    + "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

GEMMA = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' %}"
    + _GEMMA_TURN_OPEN
    + "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    + _GEMMA_GENERATION_PROMPT
)

MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    + _ROLES_ALTERNATE
    + "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

#: Qwen2.5-VL: ChatML whose message content may be a list of image and text parts.
QWEN2_5_VL = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    + _QWEN_DEFAULT_SYSTEM
    + "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    + _CHATML_GENERATION_PROMPT + "{%- endif %}"
)

#: Gemma 3 with images: Gemma's turns whose content may be a list of image and text parts.
GEMMA3_VISION = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' %}"
    "{%- else %}{%- set first_user_prefix = messages[0]['content'][0]['text'] | trim + '\\n\\n' %}{%- endif %}"
    + _GEMMA_TURN_OPEN
    + "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    + _GEMMA_GENERATION_PROMPT
)
