"""The session's forkserver: every ``pt.launch`` of the suite forks its ranks from one server,
which imports once what the test ranks import (pytest, transformers and the models the tests
build) on top of pipetrain's own preload."""

from __future__ import annotations

from pipetrain.runtime.launch import start_context

start_context(("pytest", "transformers", "transformers.models.llama.modeling_llama",
               "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert",
               "pipetrain.train.loop", "pipetrain.parallel.sharded",
               "pipetrain.parallel.tensor_parallel", "pipetrain.checkpoint.run"))
