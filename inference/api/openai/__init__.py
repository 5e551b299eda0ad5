"""The OpenAI-compatible protocol under /v1/: models, completions, chat completions.

``urls`` (mounted at ``/v1/`` by ``specops/urls.py``) routes to the async ``views``; ``serializers``
validates a request body and turns it into SpecOps's generation request; ``chat_template`` renders
messages into a prompt; ``completion_text`` assembles the reply's text from the session's stream
(stop sequences cut, special tokens skipped); ``responses`` builds OpenAI's objects and chunks;
``errors`` is OpenAI's error shape.
"""
