"""One-off studies: each answers one question about the runner or its dependencies, with the command that
reproduces the answer. The suite a user runs is in :mod:`benchmarks`; these stay for whoever asks the
question again.

| study | the question |
|---|---|
| ``chunk_body`` | What does the runner's worker side cost one chunk, against a plain task's body? |
| ``children`` | (helper) Run a measuring half in a fresh process set up as a Dask worker is. |
| ``cold_start`` | Where does a cold start's time go, per operator? |
| ``consecutive`` | What do plans, arms, walls and the store do over consecutive runs on one store? |
| ``first_touch`` | What does a worker pay the first time an operator's working memory grows? |
| ``gpu_memory`` | How well is a task's GPU memory measured (CuPy's pool, NVML)? |
| ``idle_memory`` | What does touching memory again cost after the machine has left it free for a while? |
| ``map_overhead`` | Where does a chunked map's own time go in the flow process? |
| ``measure_overhead`` | How many milliseconds does the monitor add to a task run? |
| ``model_accuracy`` | How well does the online memory model predict the real operators? |
| ``nights`` | Does the learned policy beat the fixed heuristic over many nights? |
| ``operator_memory`` | What is each built-in operator's peak memory as a multiple of its input? |
| ``peak_time`` | When in its run does each workload-family operator reach its memory peak? |
| ``replay`` | What does a long history cost a flow run's start? |
| ``segy_scan`` | What does reading a SEG-Y file's geometry cost, scanned and kept, at 2 million traces? |
| ``setup_costs`` | What does a benchmark pay before its flows run (a server, a cluster)? |
| ``store_quality`` | How well did the memory model predict the runs kept in stores, replayed? |
| ``straggler`` | What does a worker slow rather than dead cost a map? |
| ``task_memory`` | What is one chunk's whole task's peak (read, operator, trim, write) against the operator's? |
| ``task_start`` | How long does a Prefect task run take to start on a Dask worker? |
| ``time_forms`` | Which time form did each operator's model read after each flow run? |
| ``write_memory`` | What do reading and writing a chunk's region cost in memory and time? |
"""
