# The config of Colossal-AI's legacy gradient-accumulation tutorial, as written there.
# BATCH_SIZE is the script's data loader's batch (per process); gradient_accumulation alone
# gives a data-defined plan: every micro-batch weighted by its real size.
BATCH_SIZE = 128
NUM_EPOCHS = 200
gradient_accumulation = 4
