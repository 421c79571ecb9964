// Package load is an open-loop load generator for the socialnet front end, as wrk2 drives
// DeathStarBench: requests leave on a schedule fixed in advance (constant rate, or Poisson
// arrivals at that mean rate), whether or not earlier ones have returned, and each latency is
// measured from the request's scheduled time, so a slow server cannot slow the load down and
// hide its own queueing (no coordinated omission).
package load

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Arrival processes.
const (
	Constant = "constant"
	Poisson  = "poisson"
)

// Schedule yields the send times of an open-loop run, as offsets from its start.
type Schedule struct {
	rate     float64
	duration time.Duration
	poisson  bool
	rng      *rand.Rand
	n        int
	at       time.Duration
}

// NewSchedule returns the schedule of rate requests per second for duration.
func NewSchedule(rate float64, duration time.Duration, arrivals string, rng *rand.Rand) (*Schedule, error) {
	if rate <= 0 || duration <= 0 {
		return nil, fmt.Errorf("rate and duration must be > 0, got %g/s for %s", rate, duration)
	}
	if arrivals != Constant && arrivals != Poisson {
		return nil, fmt.Errorf("arrivals must be %q or %q, got %q", Constant, Poisson, arrivals)
	}
	return &Schedule{rate: rate, duration: duration, poisson: arrivals == Poisson, rng: rng}, nil
}

// Next returns the next send time, or false when the run is over.
func (s *Schedule) Next() (time.Duration, bool) {
	if s.poisson {
		s.at += time.Duration(s.rng.ExpFloat64() / s.rate * float64(time.Second))
	} else { // from the count, not by adding intervals, so rounding does not drift
		s.at = time.Duration(math.Round(float64(s.n) * float64(time.Second) / s.rate))
	}
	s.n++
	return s.at, s.at < s.duration
}

// Mix is the share of each request kind (they need not sum to 1: they are normalised).
type Mix map[string]float64

// Kinds of request, named as in --mix.
const (
	Compose = "compose" // POST /wrk2-api/post/compose
	Home    = "home"    // GET /wrk2-api/home-timeline/read
	User    = "user"    // GET /wrk2-api/user-timeline/read
	Login   = "login"   // POST /wrk2-api/user/login
	Follow  = "follow"  // POST /wrk2-api/user/follow
)

// DefaultMix is wrk2's socialnet mix: 10% compose, 30% user timeline, 60% home timeline.
const DefaultMix = "compose=0.1,user=0.3,home=0.6"

// ParseMix reads "compose=0.1,user=0.3,home=0.6".
func ParseMix(s string) (Mix, error) {
	m := Mix{}
	total := 0.0
	for _, part := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return nil, fmt.Errorf("mix %q: want kind=share, got %q", s, part)
		}
		switch k {
		case Compose, Home, User, Login, Follow:
		default:
			return nil, fmt.Errorf("mix %q: unknown kind %q (compose, home, user, login, follow)", s, k)
		}
		w, err := strconv.ParseFloat(v, 64)
		if err != nil || w < 0 {
			return nil, fmt.Errorf("mix %q: share of %s must be a number >= 0, got %q", s, k, v)
		}
		m[k] = w
		total += w
	}
	if total <= 0 {
		return nil, fmt.Errorf("mix %q: shares sum to 0", s)
	}
	return m, nil
}

// picker draws kinds with the mix's shares.
type picker struct {
	kinds []string
	cum   []float64
}

func newPicker(m Mix) picker {
	var p picker
	for k, w := range m {
		if w > 0 { // a kind of share 0 is never drawn
			p.kinds = append(p.kinds, k)
		}
	}
	sort.Strings(p.kinds) // a seed gives the same draws whatever the map's order
	total := 0.0
	for _, k := range p.kinds {
		total += m[k]
		p.cum = append(p.cum, total)
	}
	for i := range p.cum {
		p.cum[i] /= total
	}
	return p
}

func (p picker) pick(rng *rand.Rand) string {
	u := rng.Float64()
	i := sort.SearchFloat64s(p.cum, u)
	return p.kinds[min(i, len(p.kinds)-1)]
}
