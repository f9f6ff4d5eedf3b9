"""Text in and out: the tokenizer and the incremental detokenizer."""
