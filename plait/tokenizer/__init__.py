"""Text <-> token ids on both sides of the scheduler.

    tokenizer_manager.py  TokenizerManager: runs in the frontend process (the HTTP server's, or
                          the Engine's private loop); tokenizes, sends requests to the
                          scheduler, hands each request its output
    detokenizer.py        the detokenizer process: incremental detokenization, stop strings
"""
