"""Protocol workers: with `server.workers` above 1 the transports run in worker processes, one per
core, and the engine process (the daemon's main process) keeps the firmware, the models, the batchers,
the sequences and the API core. supervisor.py runs in the engine process, worker.py is a worker's main,
channel.py is what crosses between them."""
