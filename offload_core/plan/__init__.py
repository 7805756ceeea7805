"""The plan made before anything is loaded, in one place: the :class:`~offload_core.plan.make.Plan` and its rule
(make), the request every door makes of it and the one dispatch door (request), the reservation (reserve), and the
run's cost model: its model, batches and their memory, the predicted, calibrated and learnt times, ``auto``, the hybrid
split, speculation's sizing and the printed report. The placement algorithms it uses live in offload_core.planning."""
