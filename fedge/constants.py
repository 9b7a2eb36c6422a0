"""Every default, limit and timeout of fedge's shared core, in one place."""

SPEC_SCHEMA_VERSION = 1
SPEC_METADATA_KEY = "fedge.spec"
SHAPES_CACHE_SIZE = 256  # specs whose tensor shapes are remembered (a fleet's architectures, with their origins)

# Local training (pFedClub §4.1: Adam, lr 1e-3, 10 local epochs).
DEFAULT_LR = 1e-3
DEFAULT_BATCH_SIZE = 16
# Clients on the `executorch` runtime train with ExecuTorch's on-device optimizer, SGD (Android's SGD.create).
# Measured on 600 mnist-5k images, batch 16, 5 epochs (eager SGD, the same updates): lr 0.01 with momentum 0.9
# gives cnn1 0.92 / cnn2 0.91 accuracy (Adam 1e-3: 0.92); lr 0.05 with momentum 0.9 diverges (0.23 / 0.57).
# cnn3 (8 conv layers, no BN) sits at chance for ~10 epochs under any SGD setting tried, then reaches 0.88
# after 25 epochs at lr 0.01 (Adam: 0.75 after 5).
SGD_LR = 0.01
SGD_MOMENTUM = 0.9
EXECUTORCH_TEACHER_BATCH = 32  # fixed batch of the teacher's inference program on an executorch client
EVAL_BATCH_SIZE = 512
# Clients trained in one batched computation on a CPU (launch/batched.py; a GPU takes a whole group): beyond about ten
# clients' batches the stacked activations leave the caches. Measured (2 cores, 40 clients of ~320 samples, batch 32,
# one epoch), time over the floor of 2 ideal workers at 2, 5, 10, 20, 40 clients per computation: cnn1 0.76, 0.65,
# 0.63, 0.65, 0.68; cnn4 1.08, 1.07, 1.03, 1.22, 1.45.
BATCHED_CPU_CLIENTS = 10
# The memory metrics every task reply carries (fedge.memory): the client process's current and peak RSS.
MEMORY_METRICS = ("rss_bytes", "peak_rss_bytes")

# Partitioning (pFedClub §4.1: 72 % train / 20 % test / 8 % public; 2 classes per client).
PUBLIC_FRACTION = 0.08
TEST_FRACTION_OF_CLIENT = 0.20 / 0.92
CLASSES_PER_CLIENT = 2
DIRICHLET_ALPHA = 0.5
ROUTER_LR = 1.0  # FedMN's router SGD step on its gradient summed over a task's batches (methods/fedmn/server.py)
LABEL_CLUSTERS = 3  # partition "clustered": FedEM's class groups (its CIFAR-10 setting, which FedMN uses, has 3)

# The embedded default run: small enough for a laptop, heterogeneous enough to mean something.
DEFAULT_STRATEGY = "pfedclub"
DEFAULT_DATASET = "mnist-5k"
DEFAULT_PARTITION = "noniid"
DEFAULT_ZOO = "III"
FEDGH_ZOO = "fedgh"  # the zoo giving client i FedGH's CNN i mod 5 (fedge/model/zoo.py)
DEFAULT_CLIENTS = 8
DEFAULT_ACTIVE = 4
DEFAULT_ROUNDS = 3  # the default run in under a minute on 2 cores (was 5 before issue 33)
DEFAULT_LOCAL_EPOCHS = 10  # pFedClub §4.1
DEFAULT_SEED = 0
DEFAULT_RUNS_DIR = "runs"
# Device profiles the simulated fleet cycles through (all run eager PyTorch).
DEFAULT_FLEET_PROFILES = ("rpi-4", "rpi-5", "jetson-orin-nano")
# Zoo width presets (fedge/model/zoo.py): `cpu` shrinks the models for CPU runs, `paper` follows the authors' CNN1-CNN4
# and standard-width MobileNets.
WIDTHS = ("cpu", "paper")
DEFAULT_WIDTHS = "cpu"

# Data.
DATA_CACHE_DIR = "~/.cache/fedge"
DIRICHLET_MIN_CLIENT_SAMPLES = 10
DIRICHLET_MAX_DRAWS = 100
CIFAR10_BINARY_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_BINARY_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
# A device's own data (fedge/data/own_data.py): image files it reads (other files are ignored), the share of its
# examples it holds out for testing when it brings no test split, and the luma weights of RGB -> grayscale
# (ITU-R 601-2, as Pillow's convert("L")).
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
OWN_TEST_FRACTION = 0.20
LUMA_WEIGHTS = (0.299, 0.587, 0.114)
# What reading a device's own data may take, checked against the sizes its files declare before anything is
# decoded (fedge/data/own_data.py: the raw arrays, every float32 tensor built of them and the normalised copy). A
# quarter of the device profile's memory_bytes (itself what is left after the OS and the Python + torch runtime):
# the client keeps about half of that estimate (its normalised train and test tensors) for the whole run, and the
# rest of memory_bytes is the training footprint (weights, gradients, optimiser state, a batch's activations, up
# to CANDIDATE_CHUNK candidate models at a time under pFedClub), which the profile check counts without the data.
OWN_DATA_MEMORY_SHARE = 0.25
# Where no device profile applies (`fedge predict`, the server's --public-data): 2 GiB, a laptop's or server's
# share; CIFAR-10's 50,000 training images, as uint8 32x32 RGB, take ~1.4 GB by the same count.
OWN_DATA_DEFAULT_MAX_BYTES = 2 << 30
# The most pixels (W x H) of one image, whatever the budget: 50 MP, above what common cameras write (12-50 MP)
# and below Pillow's own decompression-bomb warning (Image.MAX_IMAGE_PIXELS, ~89 MP), turned into a refusal too.
OWN_IMAGE_MAX_PIXELS = 50_000_000

# pFedClub / pFedHR (pFedClub §4.1 and §4.4: K = 4, λ = 0.2, τ = 0.07, 3 fine-tuning epochs, η = 0.1).
CLUSTERS = 4
KD_LAMBDA = 0.2
NT_XENT_TAU = 0.07
FINETUNE_EPOCHS = 3
PFEDCLUB_PLUS_ETA = 0.1
# pFedClub's cap on a client's CMSR candidates, drawn uniformly (0: all; see methods/pfedclub/cmsr.py). 4, not the 16
# of before issue 33: the default run's server step at 16 took 81 of its 148 s (docs/deviations.md); bench/reproduce.py
# keeps 16
MAX_CANDIDATES = 4
CMSR_SHUFFLE_LIMIT = 1 << 20  # up to this many CMSR paths, a capped draw shuffles them all; beyond, draws lazily
CMSR_MAX_DRAWS_PER_CANDIDATE = 64  # capped draws refused this often (pFedClub+'s bound) → list the acceptable ones
ABLATIONS = ("none", "max", "min", "noc", "nbc")
KD_TEMPERATURE = 1.0
# The KL of Eq. (5): "teacher_student" = KL(p_teacher ‖ q_student), "student_teacher" = KL(q_student ‖ p_teacher).
KD_DIRECTIONS = ("teacher_student", "student_teacher")
KD_DIRECTION = "teacher_student"  # Eq. (5)'s order is ambiguous; DML [36] and the authors' code target the teacher
FINETUNE_BATCH_SIZE = 64  # the authors used 8; 64 keeps CPU fine-tuning tolerable
FINETUNE_MIN_BATCH_SIZE = 8  # the authors' batch: a small public set reaches the step floor with batches down to it
# Floor on server fine-tuning's optimiser steps: the paper's 3 epochs over its public set (8 % of CIFAR-10's 60,000
# = 4,800 samples; MNIST's would be 5,600) at batch 64 = 3 x 75 = 225 steps. Adam moves a weight by <= lr per step,
# so 21 steps (3 epochs over 400 samples) leave a randomly initialised stitch random.
FINETUNE_MIN_STEPS = 225
AUGMENT_CROP_PAD = 2  # NT-Xent views (Eq. 3): shift by up to ±2 px ...
AUGMENT_NOISE_STD = 0.1  # ... and add Gaussian noise (no paper value: ours)
CANDIDATE_CHUNK = 32  # pFedClub builds, fine-tunes and matches a client's candidates this many at a time

# Task model roles the simulated clock (server/clock.py) reads: the model a client is sent to train, and a
# distillation teacher whose forward pass over the client's samples is charged once per task.
TRAINED_MODEL_ROLE = "model"
TEACHER_ROLE = "teacher"

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
# Version 2: the envelope's sha256 is the root over the chunks' SHA-256 digests (fedge.wire.envelope.root_sha256), and
# task and result payloads carry named tensors and JSON records. Version 1 peers are refused ("schema_version").
WIRE_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (2,)  # envelope versions a receiver accepts, oldest first
CHUNK_SIZE = 256 * 1024  # payload bytes per chunk message
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024  # largest reassembled payload accepted
MAX_HEADER_BYTES = 1024 * 1024  # largest JSON header (payload container or envelope); ours are kilobytes
# Memory a receiver holds for incomplete messages, counted as whole frames as received (header + chunk) plus
# the bookkeeping below; over a budget the oldest partial message is evicted (the sender re-sends it whole).
PENDING_SENDER_BYTES = 16 * 1024 * 1024  # per sender; at least 2x the size limit of the message being joined
PENDING_TOTAL_BYTES = 1024 * 1024 * 1024  # all senders together; the biggest holder's oldest partial goes first
PENDING_CHUNK_OVERHEAD_BYTES = 256  # per kept chunk: its dict entry and memoryview
PENDING_MESSAGE_OVERHEAD_BYTES = 4096  # per partial message: its record, hash state and dicts
MAX_COMPLETED_IDS = 1024  # ids of finished messages remembered, so a late repeat is recognised
MESSAGE_TTL_S = 600.0  # default envelope time to live
MAX_CLOCK_SKEW_S = 300.0  # an envelope created further in the future than this is refused ("clock_skew")
MAX_CHUNK_BYTES = 4 * 1024 * 1024  # largest chunk a receiver accepts (senders use CHUNK_SIZE)
REPLY_SLACK_BYTES = 256 * 1024  # allowance over a reply's tensor bytes for headers, the spec JSON and records
# A reply may carry a model of any architecture its device profile fits (a model that grows): sized at this many
# bytes per parameter the profile allows (float32 weights plus as much again for buffers such as BN statistics).
ANY_MODEL_BYTES_PER_PARAM = 8
MAX_RECORD_DEPTH = 32  # nesting of a JSON record in a reply
MAX_ERROR_CHARS = 1000  # a client's report of why it could not execute a task
HASH_THREADS = 2  # a sender hashes the chunks of a large payload on this many threads (hashlib releases the GIL)
HASH_PARALLEL_MIN_BYTES = 4 * 1024 * 1024  # ... when it has at least this many bytes

# MQTT rounds, liveness and reconnection.
DEFAULT_TRANSPORT = "mqtt"  # "mqtt" (embedded broker, clients as processes) or "inproc" (one process)
DEFAULT_RUN_ID = "fedge"  # topic prefix level fedge/<run>/...
TOPIC_ROOT = "fedge"
ROUND_DEADLINE_S = 600.0  # a round's replies are waited for at most this long
MIN_REPLIES = 1  # fewer training replies than this fail the round (it is retried)
ROUND_RETRIES = 2  # a failed round is tried this many more times before the run stops
REGISTER_TIMEOUT_S = 120.0  # the server waits this long for the fleet to register
HEARTBEAT_S = 5.0  # clients publish a heartbeat this often; silence for 3x marks them dead
KEEPALIVE_S = 10  # MQTT keep-alive; the broker publishes the will after 1.5x of silence
ACK_TIMEOUT_S = 10.0  # a client re-sends an unacknowledged upload or registration after this long
# A registration while the client's instruction is open gets it again (a restarted client lost it): on a new
# connection (an "online" status since it was sent) or this long after the last send, at most this many times.
TASK_RESEND_INTERVAL_S = ACK_TIMEOUT_S
MAX_TASK_RESENDS = 4
RECONNECT_MIN_S = 0.5  # reconnect backoff: jittered, doubling up to the max
RECONNECT_MAX_S = 30.0
RECONNECT_GRACE_S = 5.0  # a round waits this long for a client announced offline to come back (its link may flap)
# Upload bounds (server/bounds.py). Norms are over a model's learned parameters only: BatchNorm's running statistics
# are not what training optimises (an honest cnn4's running_var reaches 383 after 10 epochs) and get their own check.
NORM_OUTLIER_FACTOR = 100.0  # an upload whose parameter norm exceeds this x the round's median is rejected
NORM_MIN_UPLOADS = 3  # a round-relative bound (median) needs at least this many uploads
# Any round size: an upload's parameter norm may be at most this x its reference (the model of the same
# architecture the server sent, else the client's previous accepted upload, else a fresh initialisation).
# Measured: 30 epochs of local training move the zoo's parameter norms by 0.86x (MobileNetV1) to 2.6x
# (MobileNetV3-Small) from initialisation.
UPLOAD_NORM_FACTOR = 10.0
# A fresh model's BatchNorm statistics are placeholders (mean 0, variance 1), not measurements: a first upload's, or
# one trained from a global model whose statistics no client has measured yet, may be at most this x their norm.
# Measured (issue 31): an honest cnn4 on CIFAR-10 at the paper's client setting (10 epochs, ~860 training images,
# Adam 1e-3) reached 3,577, 239 x the placeholders' 14.97, and was refused at 100 x; 1e4 leaves 40x room over that,
# and the running variance of 1e11 that ruined a two-client FedAvg run is ~1e10 x.
FIRST_BUFFER_FACTOR = 1e4
# A BatchNorm running mean entry beyond MAX_FEATURE_MAGNITUDE, or a running variance beyond its square or below 0,
# is a lie (server/bounds.buffer_rejection).
# Updates (what a client uploads minus what the server sent it; strategies that send what clients train): each
# tensor's update is clipped to CLIP_FACTOR x the median RMS of that tensor's updates in the round (with fewer than
# NORM_MIN_UPLOADS updates of it, the median of its last CLIP_HISTORY accepted ones, any client's), and a reply
# whose whole parameter update has an RMS over UPDATE_OUTLIER_FACTOR x the round's median is refused.
CLIP_FACTOR = 3.0  # run key clip_factor; 0 turns clipping off
# Measured (bench/robust.py's fleets, 5 clients of 200 samples, mnist-5k, 2 seeds): honest whole parameter updates
# reach 1.32 x the round's median (FedMN without its router, whose heavy-tailed steps reach 11.3 x and are left out:
# Strategy.outlier_exempt); -9.9 x the model sent is 43-51 x. Clients with more data take more steps: 10 leaves room.
UPDATE_OUTLIER_FACTOR = 10.0
CLIP_HISTORY = 8
# Robust aggregation (server/aggregation.py), run key `aggregator`: mean (the strategy's own average), FedMedian,
# FedTrimmedAvg (trim_fraction: Flower's β default 0.2), Krum and multi-Krum (byzantine: Krum's f).
AGGREGATORS = ("mean", "median", "trimmed_mean", "krum", "multi_krum")
DEFAULT_AGGREGATOR = "mean"
TRIM_FRACTION = 0.2
KRUM_BYZANTINE = 1
# FedAvg: no client's share of a round's average may exceed this (example counts are self-reported). 0.5 leaves
# the default fleet's balanced rounds of 4 as they are; with two replies it makes unequal counts count equally.
MAX_CLIENT_SHARE = 0.5
# FedTrans: a reported training loss or cell activeness outside [0, this] is a lie (cross-entropy starts near ln(C);
# ‖mean gradient‖/‖W‖ is far below 1 in practice) and is left out, counted in summary.json (`ignored_reports`).
MAX_REPORTED_LOSS = 1e4
MAX_REPORTED_ACTIVENESS = 1e4
# FedTrans growth (methods/fedtrans/server.py): DoC (Eq. 1) and cell activeness advance only on reports of at least
# this many distinct clients of the newest model, so that their median is bounded by honest reports when one client
# lies; a round with fewer reporters adds its reports to a pool that carries over to later rounds until this many
# clients (each with its latest report) have reported.
MIN_GROWTH_REPORTERS = 3
# DC-PFL / FedGH statistics uploads (methods/dcpfl/maths.statistics_rejection) and BatchNorm running statistics
# (server/bounds.buffer_rejection). Features of a trained network are O(1-100); a class mean or running mean entry
# beyond this, or a covariance or running variance entry beyond its square, is a lie.
MAX_FEATURE_MAGNITUDE = 1e6
SYMMETRY_TOLERANCE = 1e-5  # max |Σ − Σᵀ| allowed, relative to max |Σ| (the client sends Σ exactly symmetric)
PSD_TOLERANCE = 1e-4  # smallest eigenvalue allowed: −this x the largest (float32 rounding of a PSD matrix)
# DC-PFL / FedGH statistics against the round (methods/dcpfl/maths.scale_rejections): a reply holding a class whose
# mean norm ‖µ_c‖ or spread √tr Σ_c exceeds STATISTICS_SCALE_FACTOR x its reference is refused ("statistics_scale").
# The reference: the median over the round's replies holding the class, when at least STATISTICS_MIN_REPLIES do;
# else the round's scale (the median over at least that many replies of each one's median over its classes); else
# the server's global statistics of the class (DC-PFL). Measured on honest runs (mnist-5k, zoos fedgh and cnn1,
# non-IID 2 classes and Dirichlet 0.3, 4-6 clients, 4 rounds): value / reference reached 2.5 (mean norms 4-95,
# spreads 1-14); 10 leaves 4x to spare.
STATISTICS_SCALE_FACTOR = 10.0
STATISTICS_MIN_REPLIES = 3

# Brokers (fedge/brokers/embedded_broker.py and fedge/brokers/mosquitto.py).
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + 64 * 1024  # largest MQTT packet a broker accepts: one chunk plus headers
# What a broker holds for one client to deliver: Mosquitto's queue beyond its in-flight window, RabbitMQ's
# subscription queue (oldest dropped), the embedded broker's deliveries in progress (newest dropped). A whole
# largest task and one re-send (server/fleet.py re-sends a task to a re-registering client at most MAX_TASK_RESENDS
# times, TASK_RESEND_INTERVAL_S apart on one connection).
MAX_QUEUED_MESSAGES = 4096  # holds a whole model's chunks
MAX_QUEUED_BYTES = 2 * MAX_PAYLOAD_BYTES  # ... and its byte cap (what is over is dropped, silently but for embedded)
# The embedded broker hands freed memory back to the OS (glibc's malloc_trim) when deliveries of at least this many
# bytes held for one connection are over: glibc keeps large frees of a busy process otherwise.
BROKER_TRIM_BYTES = 64 * 1024 * 1024
MAX_USER_CONNECTIONS = 4  # RabbitMQ: connections one user may hold at once (a reconnect may overlap a dying one)
IDLE_QUEUE_EXPIRES_S = 60  # RabbitMQ: a subscription queue nobody consumes from is deleted after this long
PERSISTENT_SESSION_EXPIRES_H = 1  # Mosquitto: the same for a non-clean session, in hours (its smallest unit)
MAX_KEEPALIVE_S = 60  # Mosquitto refuses MQTT 3.1.1 clients asking for a longer keep-alive
BROKER_START_TIMEOUT_S = 10.0
BROKER_STOP_TIMEOUT_S = 10.0
CONNECT_PACKET_TIMEOUT_S = 10.0  # the embedded broker drops a connection that sends no CONNECT within this long
LISTEN_BACKLOG = 512  # pending TCP connections; a fleet reconnecting at once must not overflow it
PASSWORD_BYTES = 32  # entropy of generated passwords (secrets.token_urlsafe)
PBKDF2_ITERATIONS = 101  # mosquitto_passwd 2.0's default for its $7$ (PBKDF2-SHA512) hashes
PBKDF2_SALT_BYTES = 12

# MQTT connections and launchers.
MQTT_QOS = 1  # at least once: receivers deduplicate by message id and chunk
FRAME_QUEUE_LENGTH = 16  # received frames waiting to be checked; a full queue makes paho (and TCP) wait
FLUSH_TIMEOUT_S = 5.0  # a disconnecting endpoint waits this long for its last messages to leave
# The server's close: how long it waits for live clients to say "offline" after their stop, re-sending it this often
STOP_WAIT_S, STOP_RESEND_S = 5.0, 1.0
WILL_TTL_S = 365 * 24 * 3600.0  # a will is composed at connect time and may be published much later
MAX_TTL_S = WILL_TTL_S  # the longest life an envelope may claim (a will's); longer, or not positive, is "bad_ttl"
CONNECT_TIMEOUT_S = 60.0  # server and clients give up reaching the broker after this long
CLIENT_EXIT_GRACE_S = 20.0  # `fedge run` waits this long for client processes to exit after the run
CLIENT_STATE_DIR = "clients"  # <out>/clients/<id>: each client's model snapshots
FINAL_MODELS_DIR = "models"  # <out>/models/<id>/teacher.{safetensors,onnx}: final models written after a run
CHECKPOINT_VERSION = 1  # bump when the checkpoint skeleton encoding changes; older files are then refused
CMSR_INDEX = "raw"  # CMSR's order constraint compares raw block indices (Alg. 1); "relative" = position / depth
