"""The detokenizer process: incremental detokenization state (state.py) and its loop (process.py)."""
