"""Prompt data: dataset files and tokenization (``dataset.py``), the resumable prompt stream
(``prompt_stream.py``), built-in tasks (``tasks.py``)."""
