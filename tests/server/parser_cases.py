"""Recorded outputs for the reasoning and tool-call parsers, in each family's published format (the model
cards' and chat-template docs' examples, plus cut and malformed variants), with the expected split."""

from __future__ import annotations

# (parser, output text, expected reasoning, expected content)
REASONING = [
    # Qwen3 with thinking on: the model opens <think> itself.
    ("qwen3", "<think>\nOkay, the user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = 4.",
     "Okay, the user asks for 2+2. That is 4.", "2 + 2 = 4."),
    # Qwen3 answering without a think block: all answer, verbatim.
    ("qwen3", "The capital of France is Paris.", "", "The capital of France is Paris."),
    # an empty think block (what Qwen3 writes with enable_thinking false in its prompt, if echoed)
    ("qwen3", "<think>\n\n</think>\n\nHello!", "", "Hello!"),
    # cut by the budget inside the thinking: all reasoning
    ("qwen3", "<think>\nLet me count the letters: s-t-r-a-w", "Let me count the letters: s-t-r-a-w", ""),
    # <think> mentioned inside an answer stays text
    ("qwen3", "Use a <think> tag to open reasoning.", "", "Use a <think> tag to open reasoning."),
    ("qwen3", "  \n", "", "  \n"),
    ("qwen3", "<thi", "", "<thi"),
    # DeepSeek-R1 distills: the template opened <think>, the output starts inside it.
    ("deepseek-r1", "Okay, so I need to find 15% of 80. 0.15 * 80 = 12.\n</think>\n\n**Answer:** 12",
     "Okay, so I need to find 15% of 80. 0.15 * 80 = 12.", "**Answer:** 12"),
    ("deepseek-r1", "<think>\nFirst, 3*7=21.\n</think>\n\n21", "First, 3*7=21.", "21"),
    ("deepseek-r1", "Hmm, the budget ran out while I was still think", "Hmm, the budget ran out while I was still think",
     ""),
    ("deepseek-r1", "a </b> c</think>x </think> y", "a </b> c", "x </think> y"),
    ("kimi", "◁think▷The user greets me.◁/think▷Hello there!", "The user greets me.", "Hello there!"),
    # gpt-oss harmony: analysis channel is reasoning, final channel the answer.
    ("gpt-oss", "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer."
     "<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     "User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.", "2 + 2 = 4."),
    ("gpt-oss", "<|channel|>analysis<|message|>Need weather; call tool.<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>",
     "Need weather; call tool.",
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     "{\"location\":\"San Francisco\"}<|call|>"),
    ("gpt-oss", "<|channel|>analysis<|message|>cut off mid-thou", "cut off mid-thou", ""),
    ("gpt-oss", "Plain answer, no channels.", "", "Plain answer, no channels."),
]

WEATHER = {"get_current_weather", "get_current_temperature", "get_weather", "get_time", "get_user_info"}

# (parser, output, expected content, expected [(name, arguments JSON)])
TOOLS = [
    # Qwen2.5 function-calling docs
    ("qwen25", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, '
     'USA", "unit": "celsius"}}\n</tool_call>', "",
     [("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
      ("get_current_temperature", '{"location": "San Francisco, CA, USA", "unit": "celsius"}')]),
    ("qwen25", 'Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', "Let me look that up.", [("get_weather", '{"city": "Paris"}')]),
    # cut before </tool_call> with complete JSON: a call
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "",
     [("get_weather", '{"city": "Oslo"}')]),
    # malformed JSON, an unknown function: text
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> ok',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> ok', []),
    ("qwen25", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ("qwen25", 'The JSON {"name": "get_weather", "arguments": {}} is an example.',
     'The JSON {"name": "get_weather", "arguments": {}} is an example.', []),
    # Llama 3.1 model card (JSON-based tool calling)
    ("llama3", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": '
     '"Fahrenheit"}}', "", []),  # not among the tools: text (content checked below)
    ("llama3", '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": '
     '"Fahrenheit"}}', "", [("get_current_weather", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", '
     '"parameters": {"tz": "CET"}}', "", [("get_weather", '{"city": "Rome"}'), ("get_time", '{"tz": "CET"}')]),
    ("llama3", 'Sure.<|python_tag|>{"name": "get_time", "arguments": {}}', "Sure.", [("get_time", "{}")]),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", '{"name": "get_time", "parameters": {"tz": ', '{"name": "get_time", "parameters": {"tz": ', []),
    # Mistral 7B v0.3 model card / Nemo
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
     '"celsius"}}]', "", [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    ("mistral", 'Checking both.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": '
     '"get_time", "arguments": {"tz": "CET"}}]', "Checking both.",
     [("get_weather", '{"city": "Lyon"}'), ("get_time", '{"tz": "CET"}')]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', "",
     [("get_weather", '{"city": "Nice"}'), ("get_time", '{"tz": "UTC"}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Ly', '[TOOL_CALLS] [{"name": '
     '"get_weather", "arguments": {"city": "Ly', []),
    ("mistral", "No tools needed: [1, 2] is a list.", "No tools needed: [1, 2] is a list.", []),
    # Llama 3.2 pythonic (model card)
    ("pythonic", "[get_user_info(user_id=7890, special='black')]", "",
     [("get_user_info", '{"user_id": 7890, "special": "black"}')]),
    ("pythonic", '[get_weather(city="San Francisco", metric="celsius"), get_time(tz=None, ok=True)]', "",
     [("get_weather", '{"city": "San Francisco", "metric": "celsius"}'), ("get_time", '{"tz": null, "ok": true}')]),
    ("pythonic", '<|python_start|>[get_time(tz="UTC")]<|python_end|>', "", [("get_time", '{"tz": "UTC"}')]),
    ("pythonic", "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    ("pythonic", "[get_time(__import__('os').system('x'))]", "[get_time(__import__('os').system('x'))]", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    # DeepSeek V3 chat template
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"location": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
     '{"tz": "JST"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>', "<｜end▁of▁sentence｜>",
     [("get_weather", '{"location": "Tokyo"}'), ("get_time", '{"tz": "JST"}')]),
    ("deepseekv3", "I'll check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": "
     "\"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "I'll check.", [("get_weather", '{"location": "Oslo"}')]),
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{bad}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     "get_weather\n```json\n{bad}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
]
TOOLS[6] = (TOOLS[6][0], TOOLS[6][1], TOOLS[6][1], [])  # an unknown function stays text, verbatim
