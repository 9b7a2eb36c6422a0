"""Every default, limit and timeout of fedge's shared core, in one place."""

SPEC_SCHEMA_VERSION = 1
SPEC_METADATA_KEY = "fedge.spec"

# Local training (pFedClub §4.1: Adam, lr 1e-3, 10 local epochs).
DEFAULT_LR = 1e-3
DEFAULT_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 512

# Partitioning (pFedClub §4.1: 72 % train / 20 % test / 8 % public; 2 classes per client).
PUBLIC_FRACTION = 0.08
TEST_FRACTION_OF_CLIENT = 0.20 / 0.92
CLASSES_PER_CLIENT = 2
DIRICHLET_ALPHA = 0.5

# The embedded default run: small enough for a laptop, heterogeneous enough to mean something.
DEFAULT_STRATEGY = "pfedclub"
DEFAULT_DATASET = "mnist-5k"
DEFAULT_PARTITION = "noniid"
DEFAULT_ZOO = "III"
DEFAULT_CLIENTS = 8
DEFAULT_ACTIVE = 4
DEFAULT_ROUNDS = 5
DEFAULT_LOCAL_EPOCHS = 10  # pFedClub §4.1
DEFAULT_SEED = 0
DEFAULT_RUNS_DIR = "runs"
# Device profiles the simulated fleet cycles through (all run eager PyTorch).
DEFAULT_FLEET_PROFILES = ("rpi-4", "rpi-5", "jetson-orin-nano")

# Data.
DATA_CACHE_DIR = "~/.cache/fedge"
DIRICHLET_MIN_CLIENT_SAMPLES = 10
DIRICHLET_MAX_DRAWS = 100
CIFAR10_BINARY_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_BINARY_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"

# pFedClub / pFedHR (pFedClub §4.1 and §4.4: K = 4, λ = 0.2, τ = 0.07, 3 fine-tuning epochs, η = 0.1).
CLUSTERS = 4
KD_LAMBDA = 0.2
NT_XENT_TAU = 0.07
FINETUNE_EPOCHS = 3
PFEDCLUB_PLUS_ETA = 0.1
MAX_CANDIDATES = 4
ABLATIONS = ("none", "max", "min", "noc", "nbc")
KD_TEMPERATURE = 1.0
FINETUNE_BATCH_SIZE = 64  # the authors used 8; 64 keeps CPU fine-tuning tolerable
AUGMENT_CROP_PAD = 2  # NT-Xent views (Eq. 3): shift by up to ±2 px ...
AUGMENT_NOISE_STD = 0.1  # ... and add Gaussian noise (no paper value: ours)
PLUS_OVERSAMPLE = 4  # pFedClub+ asks CMSR for this many times more paths than it keeps, then filters
PFEDHR_MIN_BLOCKS = 4  # pFedHR candidate lengths and attempts (the authors' sample_models(4, 6, ...))
PFEDHR_MAX_BLOCKS = 6
PFEDHR_ATTEMPTS_PER_CANDIDATE = 50

# Block features, CKA and grouping.
FEATURE_BATCH_SIZE = 256
CONV_FEATURES = "pool"  # "pool": per-channel global mean (C,); "flatten": the whole map (C·H·W,)
CKA_MEMORY_LIMIT_BYTES = 1 << 30  # largest working buffer cka_matrix allocates at once
GRAM_CHUNK_ELEMENTS = 1 << 17  # longest float32 dot product summed before float64 accumulation (accuracy ~1e-6)
DEGENERATE_RTOL = 1e-5  # centred features smaller than this fraction of the raw ones count as constant
GROUPING_ITERATIONS = 10  # the authors' k_cluster always ran 10 iterations (original-code-notes §1.5)
GROUPING_RESTARTS = 4  # k-means++ seedings tried; the one with the lowest objective wins
SYMMETRY_ATOL = 1e-4  # a similarity matrix this far from symmetric is rejected
CKA_FULL_MAX_SAMPLES = 10_000  # larger public sets use unbiased minibatch CKA instead of keeping all features
CKA_MINIBATCH_SIZE = 1024
MIN_PUBLIC_SAMPLES = 8  # CKA and unbiased HSIC need a handful of samples

# Wire format.
WIRE_SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)  # envelope versions a receiver accepts, oldest first
CHUNK_SIZE = 256 * 1024  # payload bytes per chunk message
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024  # largest reassembled payload accepted
MAX_HEADER_BYTES = 1024 * 1024  # largest JSON header (payload container or envelope); ours are kilobytes
MAX_PENDING_MESSAGES = 64  # partial chunked messages kept before the oldest is evicted
MESSAGE_TTL_S = 600.0  # default envelope time to live
CMSR_INDEX = "raw"  # CMSR's order constraint compares raw block indices (Alg. 1); "relative" = position / depth
