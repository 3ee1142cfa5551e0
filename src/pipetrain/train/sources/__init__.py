"""Sources: what a run trains, the built-in GPT (:mod:`.source`) or a Hugging Face checkpoint
(:mod:`.hf_source`), and the one place a run's config chooses between them (:mod:`.choice`)."""
