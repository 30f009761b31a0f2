"""The training layer: data, optimiser, the sharded train step, memory plan, checkpoints, logs
and the loop that joins them (:func:`linear_gpt2.training.trainer.train`).

- :mod:`.config`: the run's typed config (six sections; YAML and dotted overrides);
- :mod:`.data`: sources, packing, shards and the per-host loader;
- :mod:`.optim`, :mod:`.sharding`, :mod:`.train_step`, :mod:`.batches`: the update;
- :mod:`.memory_plan`: ``model.remat`` / ``model.loss_chunk`` ``auto``;
- :mod:`.checkpoint`, :mod:`.logger`, :mod:`.spikes`, :mod:`.trained`: state and records;
- :mod:`.distributed`: multi-host start-up; :mod:`.trainer`: the loop.
"""
