"""Training: the ``pipetrain train`` job (a pipelined GPT on a byte corpus) and its parts."""
