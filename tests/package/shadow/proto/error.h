// An application's own "proto/error.h", first on the consumer's include path: dcp's installed
// headers include each other as "dcp/proto/error.h", so this one must never be picked up.
#error "dcp's headers picked up the application's proto/error.h instead of dcp/proto/error.h"
