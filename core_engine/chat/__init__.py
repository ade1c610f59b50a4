"""Chat formatting shared by every native backend: templates, tools, reasoning.

- :mod:`~core_engine.chat.template`: the model's Jinja chat template, sandboxed;
- :mod:`~core_engine.chat.formats`: which tool-call and reasoning syntax a template speaks;
- :mod:`~core_engine.chat.prompt`: messages and tools rendered through the template, or
  through the fallback tool prompt for templates that know no tools;
- :mod:`~core_engine.chat.content_text`: control-token texts written in a request's content
  stay text when the rendered prompt is tokenized;
- :mod:`~core_engine.chat.tool_grammar`: the grammar that makes ``tool_choice = "required"``
  or a named function always produce a valid call;
- :mod:`~core_engine.chat.tool_calls` and :mod:`~core_engine.chat.reasoning`: streaming
  parsers of the output;
- :mod:`~core_engine.chat.budget`: the thinking budget the engines enforce.

Nothing here imports torch.
"""
