package load

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Options of a load run.
type Options struct {
	Target      string        // base URL of nginx-web-server
	Rate        float64       // requests per second
	Duration    time.Duration // length of the timed run
	Mix         Mix
	Arrivals    string // Constant or Poisson
	Seed        uint64
	Users       int           // user ids 1..Users
	Init        bool          // register the users and their follows first
	Follows     int           // followees per user at init
	Posts       int           // posts each user composes at init, after the follows
	Timeout     time.Duration // per request
	MaxInFlight int           // beyond this, a due request is counted dropped, not sent
}

// Stats summarises the requests of one kind (or all).
type Stats struct {
	Sent    int     `json:"sent"`
	OK      int     `json:"ok"`
	Errors  int     `json:"errors"`
	Dropped int     `json:"dropped"`
	P50MS   float64 `json:"p50_ms"`
	P95MS   float64 `json:"p95_ms"`
	P99MS   float64 `json:"p99_ms"`
	MaxMS   float64 `json:"max_ms"`
	MeanMS  float64 `json:"mean_ms"`
}

// InitStats summarises the set-up requests (registrations, follows).
type InitStats struct {
	Users    int     `json:"users"`
	Follows  int     `json:"follows"`
	Posts    int     `json:"posts"`
	Reads    int     `json:"reads"`
	Errors   int     `json:"errors"`
	Seconds  float64 `json:"seconds"`
	FirstErr string  `json:"first_error,omitempty"`
}

// Summary is what a run prints.
type Summary struct {
	Target       string           `json:"target"`
	Rate         float64          `json:"rate"`
	Arrivals     string           `json:"arrivals"`
	Seconds      float64          `json:"seconds"`
	AchievedRate float64          `json:"achieved_rate"`
	Stopped      bool             `json:"stopped_early"`
	Stats                         // all kinds together
	ByKind       map[string]Stats `json:"by_kind"`
	ErrorSamples []string         `json:"error_samples,omitempty"`
	Init         *InitStats       `json:"init,omitempty"`
}

type result struct {
	kind    string
	latency time.Duration
	err     error
}

// Run sends the load and returns its summary; ctx ending stops the schedule early (requests
// in flight are still waited for, up to the timeout).
func Run(ctx context.Context, o Options) (*Summary, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(o.Seed, 0x5eed))
	sched, err := NewSchedule(o.Rate, o.Duration, o.Arrivals, rng)
	if err != nil {
		return nil, err
	}
	client := &http.Client{Timeout: o.Timeout, Transport: &http.Transport{
		MaxIdleConns: o.MaxInFlight, MaxIdleConnsPerHost: o.MaxInFlight, IdleConnTimeout: 30 * time.Second}}
	defer client.CloseIdleConnections()
	g := &generator{o: o, client: client, rng: rng}
	sum := &Summary{Target: o.Target, Rate: o.Rate, Arrivals: o.Arrivals}
	if o.Init {
		sum.Init = g.setUp(ctx)
	}

	picker := newPicker(o.Mix)
	var (
		mu       sync.Mutex
		results  []result
		dropped  = map[string]int{}
		inFlight atomic.Int64
		wg       sync.WaitGroup
	)
	start := time.Now()
	timer := time.NewTimer(0)
	defer timer.Stop()
loop:
	for {
		at, ok := sched.Next()
		if !ok {
			break
		}
		timer.Reset(time.Until(start.Add(at)))
		select {
		case <-ctx.Done():
			sum.Stopped = true
			break loop
		case <-timer.C:
		}
		kind := picker.pick(rng)
		req := g.request(kind)
		if inFlight.Load() >= int64(o.MaxInFlight) {
			dropped[kind]++
			continue
		}
		inFlight.Add(1)
		wg.Add(1)
		due := start.Add(at)
		go func() {
			defer wg.Done()
			defer inFlight.Add(-1)
			err := g.send(req)
			mu.Lock()
			results = append(results, result{kind, time.Since(due), err})
			mu.Unlock()
		}()
	}
	wg.Wait()
	sum.Seconds = time.Since(start).Seconds()
	summarise(sum, results, dropped)
	return sum, nil
}

func (o *Options) validate() error {
	var errs []error
	if u, err := url.Parse(o.Target); err != nil || u.Scheme != "http" || u.Host == "" {
		errs = append(errs, fmt.Errorf("target must be http://host:port, got %q", o.Target))
	}
	if o.Users < 2 {
		errs = append(errs, fmt.Errorf("users must be >= 2, got %d", o.Users))
	}
	if o.Posts < 0 {
		errs = append(errs, fmt.Errorf("posts must be >= 0, got %d", o.Posts))
	}
	if o.Follows < 0 || o.Follows >= o.Users {
		errs = append(errs, fmt.Errorf("follows must be in 0..users-1, got %d", o.Follows))
	}
	if o.Timeout <= 0 || o.MaxInFlight < 1 {
		errs = append(errs, errors.New("timeout must be > 0 and max in-flight >= 1"))
	}
	if len(o.Mix) == 0 {
		errs = append(errs, errors.New("mix is empty"))
	}
	return errors.Join(errs...)
}

type generator struct {
	o      Options
	client *http.Client
	rng    *rand.Rand // used by the scheduling goroutine only
}

// httpRequest is a request built on schedule and sent by its own goroutine.
type httpRequest struct {
	method string
	path   string
	form   url.Values
}

func username(id int) string { return "username_" + strconv.Itoa(id) }
func password(id int) string { return "password_" + strconv.Itoa(id) }

func (g *generator) user() int { return 1 + g.rng.IntN(g.o.Users) }

// request builds a request of kind with wrk2's parameters (compose-post text carries
// mentions and links, as DeathStarBench's compose-post.lua writes it).
func (g *generator) request(kind string) httpRequest {
	id := g.user()
	v := url.Values{}
	switch kind {
	case Compose:
		return g.compose(id)
	case Home, User:
		return g.timeline(kind, id)
	case Login:
		v.Set("username", username(id))
		v.Set("password", password(id))
		return httpRequest{http.MethodPost, "/wrk2-api/user/login", v}
	default: // Follow
		other := g.user()
		for other == id {
			other = g.user()
		}
		v.Set("user_id", strconv.Itoa(id))
		v.Set("followee_id", strconv.Itoa(other))
		return httpRequest{http.MethodPost, "/wrk2-api/user/follow", v}
	}
}

// timeline builds user id's read of the first page of its home or user timeline.
func (g *generator) timeline(kind string, id int) httpRequest {
	v := url.Values{}
	v.Set("user_id", strconv.Itoa(id))
	v.Set("start", "0")
	v.Set("stop", "10")
	path := "/wrk2-api/home-timeline/read"
	if kind == User {
		path = "/wrk2-api/user-timeline/read"
	}
	return httpRequest{http.MethodGet, path, v}
}

// compose builds user id's compose-post request, its text carrying mentions and links as
// DeathStarBench's compose-post.lua writes it.
func (g *generator) compose(id int) httpRequest {
	v := url.Values{}
	v.Set("username", username(id))
	v.Set("user_id", strconv.Itoa(id))
	var text strings.Builder
	text.WriteString(randomText(g.rng, 64))
	for range g.rng.IntN(4) {
		text.WriteString(" @" + username(g.user()))
	}
	for range g.rng.IntN(3) {
		text.WriteString(" http://" + randomText(g.rng, 24))
	}
	v.Set("text", text.String())
	var ids, types []string
	for range g.rng.IntN(3) {
		ids = append(ids, strconv.FormatInt(g.rng.Int64N(1<<53), 10))
		types = append(types, "png")
	}
	v.Set("media_ids", "["+strings.Join(ids, ",")+"]")
	v.Set("media_types", "["+strings.Join(types, ",")+"]")
	v.Set("post_type", "0")
	return httpRequest{http.MethodPost, "/wrk2-api/post/compose", v}
}

func randomText(rng *rand.Rand, n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	b := make([]byte, n)
	for i := range b {
		b[i] = alphabet[rng.IntN(len(alphabet))]
	}
	return string(b)
}

func (g *generator) send(r httpRequest) error {
	var (
		req *http.Request
		err error
	)
	if r.method == http.MethodGet {
		req, err = http.NewRequest(r.method, g.o.Target+r.path+"?"+r.form.Encode(), nil)
	} else {
		req, err = http.NewRequest(r.method, g.o.Target+r.path, strings.NewReader(r.form.Encode()))
		if err == nil {
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		}
	}
	if err != nil {
		return err
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: HTTP %d: %s", r.path, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	return nil
}

// setUp registers users 1..Users, has each follow Follows others, then has each compose Posts
// posts and (with posts) reads each user's two timelines once (closed loop, 16 at a time: it is
// preparation, not load), so that the timelines and caches the run reads already hold what they
// will hold once the run has been going for a while. Registering twice is harmless.
func (g *generator) setUp(ctx context.Context) *InitStats {
	start := time.Now()
	st := &InitStats{Users: g.o.Users}
	var reqs []httpRequest
	for id := 1; id <= g.o.Users; id++ {
		v := url.Values{"user_id": {strconv.Itoa(id)}, "username": {username(id)}, "password": {password(id)},
			"first_name": {"first_" + strconv.Itoa(id)}, "last_name": {"last_" + strconv.Itoa(id)}}
		reqs = append(reqs, httpRequest{http.MethodPost, "/wrk2-api/user/register", v})
	}
	g.runAll(ctx, reqs, st)
	reqs = reqs[:0]
	for id := 1; id <= g.o.Users; id++ {
		added := 0
		for _, j := range g.rng.Perm(g.o.Users) {
			if added == g.o.Follows {
				break
			}
			if followee := j + 1; followee != id {
				reqs = append(reqs, httpRequest{http.MethodPost, "/wrk2-api/user/follow",
					url.Values{"user_id": {strconv.Itoa(id)}, "followee_id": {strconv.Itoa(followee)}}})
				added++
			}
		}
	}
	st.Follows = len(reqs)
	g.runAll(ctx, reqs, st)
	// posts last, so each fans out to its author's followers' home timelines as in the run
	reqs = reqs[:0]
	for range g.o.Posts {
		for id := 1; id <= g.o.Users; id++ {
			reqs = append(reqs, g.compose(id))
		}
	}
	st.Posts = len(reqs)
	g.runAll(ctx, reqs, st)
	if g.o.Posts > 0 {
		// each timeline read once, so the caches hold the posts the run reads (their warm-up
		// after the posts slowed post-storage-service's CPU use for minutes: bmeg README, session 22)
		reqs = reqs[:0]
		for id := 1; id <= g.o.Users; id++ {
			reqs = append(reqs, g.timeline(Home, id), g.timeline(User, id))
		}
		st.Reads = len(reqs)
		g.runAll(ctx, reqs, st)
	}
	st.Seconds = time.Since(start).Seconds()
	return st
}

func (g *generator) runAll(ctx context.Context, reqs []httpRequest, st *InitStats) {
	var mu sync.Mutex
	work := make(chan httpRequest)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range work {
				if err := g.send(r); err != nil {
					mu.Lock()
					st.Errors++
					if st.FirstErr == "" {
						st.FirstErr = err.Error()
					}
					mu.Unlock()
				}
			}
		}()
	}
	for _, r := range reqs {
		if ctx.Err() != nil {
			break
		}
		work <- r
	}
	close(work)
	wg.Wait()
}

func summarise(sum *Summary, results []result, dropped map[string]int) {
	byKind := map[string][]result{}
	for _, r := range results {
		byKind[r.kind] = append(byKind[r.kind], r)
		if r.err != nil && len(sum.ErrorSamples) < 5 {
			sum.ErrorSamples = append(sum.ErrorSamples, r.kind+": "+r.err.Error())
		}
	}
	sum.ByKind = map[string]Stats{}
	for kind, rs := range byKind {
		sum.ByKind[kind] = stats(rs, dropped[kind])
	}
	total := 0
	for _, d := range dropped {
		total += d
	}
	sum.Stats = stats(results, total)
	if sum.Seconds > 0 {
		sum.AchievedRate = float64(sum.Sent) / sum.Seconds
	}
}

// stats counts results; latency percentiles are over the successful requests.
func stats(rs []result, dropped int) Stats {
	s := Stats{Sent: len(rs), Dropped: dropped}
	var ms []float64
	for _, r := range rs {
		if r.err != nil {
			s.Errors++
			continue
		}
		s.OK++
		ms = append(ms, float64(r.latency)/float64(time.Millisecond))
	}
	if len(ms) == 0 {
		return s
	}
	sort.Float64s(ms)
	q := func(p float64) float64 { return round3(ms[min(len(ms)-1, int(p*float64(len(ms))))]) }
	total := 0.0
	for _, v := range ms {
		total += v
	}
	s.P50MS, s.P95MS, s.P99MS, s.MaxMS, s.MeanMS = q(0.50), q(0.95), q(0.99), round3(ms[len(ms)-1]), round3(total/float64(len(ms)))
	return s
}

func round3(v float64) float64 { return float64(int64(v*1000+0.5)) / 1000 }
