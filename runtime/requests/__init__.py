"""What happens per request: the jobs a request becomes (jobs), what their device work costs (cost), admission and
device rounds (scheduler: admission and round_builder over the backlog they share; slices), the device thread that
runs the rounds (device_thread), the scorer that runs a round's device batches on the compiled programs (scorer),
and the traces of a round (spans). Imports the shapes (runtime.shapes), never how a scorer is built."""
