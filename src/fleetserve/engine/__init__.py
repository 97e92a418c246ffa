"""One inference instance below its front door: the scheduler, radix cache, sampler and
model runner, the rank processes and their one start-up path, the DP controller and relay,
and the messages between processes."""
