"""What every policy is built on: the `LocalScheduler` / `GlobalScheduler` contracts
(`contracts`), the local core and its shared parts (`local_core`, `selector`, `order`,
`decode_run`, `migrations`, `step_monitor`, `slack`), continuous batching with chunked prefill
(`continuous_batching`, the default local scheduler), the composed global scheduler and its
pools (`compose`, `pools`), and the `Policy` type (`policy`). Nothing here imports a paper's
package."""
