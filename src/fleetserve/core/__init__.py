"""The contract between scheduler and model: what one forward sees (ForwardBatch,
ForwardMode) and where its KV lives (the KV pools). The bottom floor: imports
no other fleetserve package."""
